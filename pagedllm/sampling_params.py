"""`SamplingParams`: how a request picks its tokens and when it stops (vLLM's names, defaults)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedllm.value_checks import INT64_MAX, check_float, check_int, check_text, short_repr

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
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice: must be a list of non-empty strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None:
                check_text(f"structured_outputs.{name}", getattr(self, name))
        for choice in self.choice or ():
            check_text("structured_outputs.choice", choice)
        if isinstance(self.json, str):
            check_text("structured_outputs.json", self.json)
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json: must be a JSON schema (a dict or its text)")
        if self.max_whitespace is not None:
            try:
                self.max_whitespace = check_int("max_whitespace", self.max_whitespace, 0)
            except ValueError:
                raise ValueError(
                    "structured_outputs.max_whitespace: must be an integer >= 0 or None"
                ) from None

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
        self.stop = _as_list("stop", self.stop)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        self._validate_sampling()
        self._validate_stopping()
        self._validate_outputs()

    def _validate_sampling(self) -> None:
        # Every number is checked for its type, range and finiteness here, and stored as a
        # plain int or float: offline callers get the same refusals as the server, and
        # nothing wider than the engine's int64 (or NaN) reaches a step.
        self.n = check_int("n", self.n, 1)
        self.temperature = check_float("temperature", self.temperature, 0.0)
        self.top_p = check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.top_k = check_int("top_k", self.top_k, -1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disable) or at least 1, got 0")
        self.min_p = check_float("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = check_float("presence_penalty", self.presence_penalty, -2, 2)
        self.frequency_penalty = check_float("frequency_penalty", self.frequency_penalty, -2, 2)
        self.repetition_penalty = check_float(
            "repetition_penalty", self.repetition_penalty, 0.0, low_open=True
        )
        if self.seed is not None:
            # Completion i is seeded seed + i: every one of them must fit 64 bits.
            try:
                self.seed = check_int("seed", self.seed, _MIN_SEED, _MAX_SEED - self.n + 1)
            except ValueError:
                raise ValueError(
                    f"seed must be an integer in [{_MIN_SEED}, {_MAX_SEED}] (with n={self.n}, "
                    f"seed + {self.n - 1} too), got {short_repr(self.seed)}"
                ) from None
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids(
                "allowed_token_ids", _as_list("allowed_token_ids", self.allowed_token_ids)
            )
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of non-negative ids")
        if self.bad_words is not None:
            self.bad_words = _as_list("bad_words", self.bad_words)
            for word in self.bad_words:
                check_text("bad_words", word)

    def _validate_stopping(self) -> None:
        if self.max_tokens is not None:
            self.max_tokens = check_int("max_tokens", self.max_tokens, 1)
        self.min_tokens = check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop must hold non-empty strings, got {type(stop).__name__}")
            check_text("stop", stop)
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")

    def _validate_outputs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, check_int(name, value, 0))
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = check_int(
                "truncate_prompt_tokens", self.truncate_prompt_tokens, 1
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON


def _as_list(name: str, value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list, got {type(value).__name__}")
    return list(value)


def _token_ids(name: str, values: list) -> list[int]:
    """Non-negative ids within int64 (the input processor checks them against the
    vocabulary, which SamplingParams does not know)."""
    if not values:
        return values
    plain = all(type(value) is int for value in values)
    if plain and min(values) >= 0 and max(values) <= INT64_MAX:
        return values  # the common case, in C loops
    try:
        return [check_int(name, value, 0) for value in values]
    except ValueError:
        raise ValueError(f"{name} must be non-negative ints below 2**63") from None


def _logit_bias(logit_bias: Any) -> dict[int, float]:
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {logit_bias!r}")
    checked = {}
    for key, bias in logit_bias.items():
        try:
            token_id = check_int("logit_bias", int(key) if isinstance(key, str) else key, 0)
            checked[token_id] = check_float("logit_bias", bias, -_MAX_LOGIT_BIAS, _MAX_LOGIT_BIAS)
        except ValueError:
            raise ValueError(
                f"logit_bias: token {short_repr(key)} -> {short_repr(bias)}; ids must be token ids "
                f"(ints >= 0) and biases finite numbers in "
                f"[-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}]"
            ) from None
    return checked
