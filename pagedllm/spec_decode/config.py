"""`SpeculativeConfig`: what `speculative_config` (vLLM's names) asks for, checked on its own.

Checks that need the target model (vocabulary, context length, the engine's layout) are made
where the engine config is built (`core/engine_config.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from pagedllm.value_checks import check_known_keys, json_object

METHODS = ("ngram", "suffix", "draft_model", "self_quantized", "eagle", "eagle3", "medusa")
# Methods whose `model` is a light head on the target's hidden states.
HEAD_METHODS = ("eagle", "eagle3", "medusa")
# Methods whose drafts write KV of their own (lookahead slots past the verified tokens).
KV_METHODS = ("draft_model", "self_quantized", "eagle", "eagle3")
# Methods with a `model` of their own (a directory).
MODEL_METHODS = ("draft_model", *HEAD_METHODS)
SELF_QUANTIZATIONS = ("gguf", "int8")
# vLLM's defaults for prompt lookup when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
# Most draft tokens a step may propose: every step reserves KV slots and sampler rows for
# them, so 1,000,000 (once accepted) sized a step no request could run. Drafts past a few
# dozen tokens are almost never all accepted.
MAX_SPECULATIVE_TOKENS = 128


@dataclass(frozen=True)
class SpeculativeConfig:
    """How requests speculate. `method`:

    - "ngram": prompt lookup; the last `prompt_lookup_min`..`prompt_lookup_max` tokens are
      searched for earlier in the request, and what followed them is proposed.
    - "suffix": suffix decoding; a suffix tree over the request's own tokens and the outputs
      of up to `suffix_decoding_max_cached_requests` earlier requests proposes the most
      frequent continuation.
    - "draft_model": a smaller model (`model`, the same tokenizer) proposes.
    - "self_quantized": the target's own weights, quantized (`quantization` "gguf": the GGUF
      file's blocks kept quantized; "int8": int8 weights), propose for the full-precision
      target.
    - "eagle3" / "eagle": an EAGLE-3 / EAGLE head (`model`, its directory) drafts from the
      target's hidden states of the step that verified (EAGLE-3: three of its layers;
      EAGLE: its last, normed), chained token by token.
    - "medusa": Medusa heads (`model`, FasterDecoding's or vLLM's layout) each read the
      target's last normed hidden state of the verified tokens; head i proposes the token
      i + 1 places after the one just sampled. `num_speculative_tokens` heads are used (at
      most as many as the directory holds); they keep no KV.

    `draft_tensor_parallel_size`: the draft (a model or a head) runs whole on the sampling
    rank, so only 1 is accepted (vLLM's key; other values are refused, not ignored).

    The target verifies every proposal in one forward pass; the rejection sampler keeps its
    output distribution exact (greedy output is token for token the same).
    `disable_by_batch_size`: a step with at least this many running requests does not
    speculate; an EAGLE head's requests computed in such a step stop drafting for good.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    quantization: str | None = None
    draft_tensor_parallel_size: int | None = None
    disable_by_batch_size: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}"
            )
        _check_positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be at most "
                f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if self.disable_by_batch_size is not None:
            _check_positive("disable_by_batch_size", self.disable_by_batch_size)
        self._check_ngram()
        self._check_suffix()
        self._check_model()

    def _check_ngram(self) -> None:
        if self.method != "ngram":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"speculative_config.{name} applies to method 'ngram' only, "
                        f"got method {self.method!r}"
                    )
            return
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        # vLLM's rule: one bound given sets the other; none gives 5 for both.
        low = low if low is not None else (high if high is not None else DEFAULT_PROMPT_LOOKUP)
        high = high if high is not None else low
        _check_positive("prompt_lookup_min", low)
        _check_positive("prompt_lookup_max", high)
        if low > high:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({low}) must not exceed "
                f"prompt_lookup_max ({high})"
            )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    def _check_suffix(self) -> None:
        _check_positive("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth)
        cached = self.suffix_decoding_max_cached_requests
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
            raise ValueError(
                "speculative_config.suffix_decoding_max_cached_requests must be a "
                f"non-negative integer, got {cached!r}"
            )
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not _is_number(factor) or factor <= 0:
            raise ValueError(
                "speculative_config.suffix_decoding_max_spec_factor must be a positive "
                f"number, got {factor!r}"
            )
        if not _is_number(prob) or not 0 <= prob <= 1:
            raise ValueError(
                f"speculative_config.suffix_decoding_min_token_prob must be in [0, 1], got {prob!r}"
            )

    def _check_model(self) -> None:
        if self.method in MODEL_METHODS:
            if not isinstance(self.model, str) or not self.model:
                what = "head's directory" if self.method in HEAD_METHODS else "draft model's path"
                raise ValueError(
                    f"speculative_config.model (the {what}) is required for method {self.method!r}"
                )
        elif self.model is not None:
            raise ValueError(
                f"speculative_config.model applies to methods {list(MODEL_METHODS)} only, got "
                f"method {self.method!r}"
            )
        self._check_draft_tensor_parallel_size()
        if self.method == "self_quantized":
            if self.quantization not in SELF_QUANTIZATIONS:
                raise ValueError(
                    "speculative_config.quantization must be one of "
                    f"{list(SELF_QUANTIZATIONS)} for method 'self_quantized', "
                    f"got {self.quantization!r}"
                )
        elif self.quantization is not None and self.method != "draft_model":
            raise ValueError(
                f"speculative_config.quantization applies to methods 'self_quantized' and "
                f"'draft_model', got method {self.method!r}"
            )

    def _check_draft_tensor_parallel_size(self) -> None:
        size = self.draft_tensor_parallel_size
        if size is None:
            return
        if not (self.uses_draft_model or self.uses_head):
            raise ValueError(
                "speculative_config.draft_tensor_parallel_size applies to methods with a draft "
                f"model or head, got method {self.method!r}"
            )
        _check_positive("draft_tensor_parallel_size", size)
        if size != 1:
            raise ValueError(
                "speculative_config.draft_tensor_parallel_size must be 1: the draft runs whole "
                f"on the sampling rank (a split draft is not served yet), got {size}"
            )

    @property
    def uses_draft_model(self) -> bool:
        """True when a second model proposes with a KV cache of its own (it needs lookahead
        slots): a draft model, the quantized self-draft, or an EAGLE head (not Medusa's
        position-wise heads)."""
        return self.method in KV_METHODS

    @property
    def uses_head(self) -> bool:
        """True when the proposer reads the target's hidden states (EAGLE, Medusa heads)."""
        return self.method in HEAD_METHODS

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past the verified tokens a step must hold: a draft model writes the KV of
        its own proposals for the next step right after verifying."""
        return self.num_speculative_tokens if self.uses_draft_model else 0

    def speculates(self, num_requests: int) -> bool:
        """Whether a step of `num_requests` requests proposes (`disable_by_batch_size`)."""
        limit = self.disable_by_batch_size
        return limit is None or num_requests < limit

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None):
        """From `LLM(speculative_config={...})` or `--speculative-config '{json}'`; None
        stays None. Unknown keys are an error naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object("speculative_config", value)
        check_known_keys("speculative_config key", value, {f.name for f in fields(cls)})
        value = dict(value)
        if value.get("method") not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {list(METHODS)}, "
                f"got {value.get('method')!r}"
            )
        if "num_speculative_tokens" not in value:
            if value["method"] != "suffix":
                raise ValueError("speculative_config.num_speculative_tokens is required")
            # vLLM's default for suffix decoding: as deep as the tree.
            value["num_speculative_tokens"] = value.get("suffix_decoding_max_tree_depth", 24)
        return cls(**value)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_positive_int(name: str, value: object) -> None:
    """`value` is a positive int (numpy's too; never a bool), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_positive(name: str, value: object) -> None:
    check_positive_int(f"speculative_config.{name}", value)
