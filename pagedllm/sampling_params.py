"""`SamplingParams`: how a request picks its tokens and when it stops (vLLM's names, defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPSILON = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling and stopping options.

    Attributes:
        n: number of completions to return (only 1 for now).
        temperature: 0 means greedy; higher flattens the distribution. Must be >= 0.
        top_p: keep the smallest set of tokens whose probability sums to at least top_p;
            in (0, 1], 1 keeps all.
        top_k: keep the k most likely tokens; -1 (or None) keeps all; 0 is refused.
        min_p: drop tokens less likely than min_p times the most likely one; in [0, 1].
        seed: per-request random seed; the same seed gives the same tokens whatever else
            is in the batch.
        max_tokens: most tokens to generate (>= 1); None means up to max_model_len.
        stop_token_ids: token ids that end the request (the id is kept in the output).
        ignore_eos: keep generating past the end-of-sequence token.
        logprobs: return, for each generated token, its logprob and rank and the
            `logprobs` most likely alternatives (0: the token alone), from the model's raw
            distribution (before temperature and filters); at most the engine's
            `max_logprobs`. None: no logprobs.
        prompt_logprobs: the same for every prompt token after the first.
        skip_special_tokens: drop special tokens from the decoded text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.top_k is None:
            self.top_k = -1
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        if self.n != 1:
            raise ValueError(f"n must be 1 for now, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON
