"""`SamplingParams`: how a request picks its tokens and when it stops (vLLM's names, defaults)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

_GREEDY_EPSILON = 1e-5
_MAX_LOGIT_BIAS = 100.0
# torch.Generator.manual_seed takes any 64-bit value; completion i of n uses seed + i.
_MIN_SEED, _MAX_SEED = -(2**63), 2**64 - 1


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output; exactly one of the five kinds.

    Attributes:
        json: a JSON schema (a dict or its JSON text); the output is a JSON value that
            validates against it.
        regex: the output matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: the output is a sentence of this EBNF grammar (xgrammar's GBNF dialect,
            start rule `root`).
        json_object: the output is a JSON object (any keys and values).
        disable_any_whitespace: JSON without optional whitespace (compact).
        max_whitespace: the longest run of optional whitespace JSON output may hold (keeps a
            sampled model from looping on blanks); None: unlimited.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    max_whitespace: int | None = 16

    def __post_init__(self) -> None:
        given = [name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: give exactly one of json, regex, choice, grammar, "
                f"json_object; got {len(given)}{': ' + ', '.join(given) if given else ''}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice: must be a list of non-empty strings")
        if self.max_whitespace is not None and self.max_whitespace < 0:
            raise ValueError("structured_outputs.max_whitespace: must be >= 0 or None")

    @property
    def kind(self) -> str:
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False))


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """Per-request sampling and stopping options.

    Attributes:
        n: number of completions to return. They share the prompt's KV: the prompt is
            computed once; with a seed, completion i uses seed + i.
        temperature: 0 means greedy; higher flattens the distribution. Must be >= 0.
        top_p: keep the smallest set of tokens whose probability sums to at least top_p;
            in (0, 1], 1 keeps all.
        top_k: keep the k most likely tokens; -1 (or None) keeps all; 0 is refused.
        min_p: drop tokens less likely than min_p times the most likely one; in [0, 1].
        seed: per-request random seed; the same seed gives the same tokens whatever else
            is in the batch.
        presence_penalty: subtracted from the logit of every token already in the output;
            in [-2, 2], 0 is off.
        frequency_penalty: subtracted once per occurrence in the output; in [-2, 2].
        repetition_penalty: tokens seen in the prompt or the output have positive logits
            divided and negative ones multiplied by it; > 0, 1 is off.
        logit_bias: token id -> value added to its logit, each in [-100, 100].
        allowed_token_ids: only these tokens may be generated.
        bad_words: words never generated (each tokenized with and without a leading
            space; a multi-token word is blocked at its last token).
        stop: strings that end the request; the text is cut before them.
        stop_token_ids: token ids that end the request (the id is kept in the output).
        include_stop_str_in_output: keep the matched stop string in the text.
        ignore_eos: keep generating past the end-of-sequence token.
        max_tokens: most tokens to generate (>= 1); None means up to max_model_len.
        min_tokens: EOS and stop_token_ids cannot end the request before this many tokens.
        logprobs: return, for each generated token, its logprob and rank and the
            `logprobs` most likely alternatives (0: the token alone), from the model's raw
            distribution (before temperature and penalties); at most the engine's
            `max_logprobs`. None: no logprobs.
        prompt_logprobs: the same for every prompt token after the first.
        detokenize: decode text (False leaves `text` empty; stop strings need it).
        skip_special_tokens: drop special tokens from the decoded text.
        spaces_between_special_tokens: put spaces between special tokens in the text.
        truncate_prompt_tokens: keep only the last k prompt tokens (k >= 1).
        output_kind: what each streamed output holds (cumulative, delta, final only).
        structured_outputs: constrain the output to a JSON schema, regex, choice list or
            grammar (`StructuredOutputsParams`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.top_k is None:
            self.top_k = -1
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate_sampling()
        self._validate_stopping()
        self._validate_outputs()

    def _validate_sampling(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}"
            )
        if self.seed is not None and (
            not isinstance(self.seed, int) or not _MIN_SEED <= self.seed <= _MAX_SEED - self.n + 1
        ):
            raise ValueError(
                f"seed must be an integer in [{_MIN_SEED}, {_MAX_SEED}] (with n={self.n}, "
                f"seed + {self.n - 1} too), got {self.seed!r}"
            )
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0 or not -_MAX_LOGIT_BIAS <= bias <= _MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias: token {token_id} -> {bias}; ids must be >= 0 and biases "
                    f"in [-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}]"
                )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(t < 0 for t in self.allowed_token_ids)
        ):
            raise ValueError("allowed_token_ids must be a non-empty list of non-negative ids")

    def _validate_stopping(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")

    def _validate_outputs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON
