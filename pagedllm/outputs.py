"""What generation returns: `RequestOutput` per prompt with one `CompletionOutput` per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's log-probability, its rank among all tokens (1 = most likely), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, holding the chosen token and the top alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless the request asked for logprobs
    # "stop", "length", "abort", "error" (it failed alone; see `error`) or None while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    logprobs: list[PositionLogprobs] | None = None  # one per token, if asked for
    error: str | None = None  # finish_reason "error": what failed for this sequence, in a line

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times (time.monotonic seconds) in one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    metrics: RequestMetrics | None = None
    # None for the first prompt token, then one dict per prompt token, if asked for.
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def error(self) -> str | None:
        """What failed, if a sequence here ended with finish_reason "error" (else None)."""
        return next((c.error for c in self.outputs if c.error is not None), None)


@dataclass
class PoolingOutput:
    """An embedding request's vector (vLLM's `EmbeddingOutput.embedding`); None if it
    failed (see `PoolingRequestOutput.error`)."""

    embedding: list[float] | None


@dataclass
class PoolingRequestOutput:
    """What an embedding request returns (`LLM.embed`, /v1/embeddings)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    metrics: RequestMetrics | None = None
    error: str | None = None  # it failed on its own in the engine: what failed


# vLLM's name for the same thing.
EmbeddingRequestOutput = PoolingRequestOutput
