"""`Request`: one generation request as the scheduler sees it, and its lifecycle states."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.core.messages import EngineCoreRequest


# A request with n > 1 runs as n engine requests: itself (sample 0) and `<id>#<i>` for the
# samples the scheduler forks. Client ids may not hold the separator (`check_request_id`).
CHILD_SEPARATOR = "#"


def child_request_id(parent_id: str, index: int) -> str:
    """Id of the index-th parallel sample of a request with n > 1 (index 0 is the parent)."""
    return parent_id if index == 0 else f"{parent_id}{CHILD_SEPARATOR}{index}"


def is_child_request(request_id: str) -> bool:
    """Whether the id names a forked parallel sample (index > 0) rather than a request."""
    return CHILD_SEPARATOR in request_id


def family_id(request_id: str) -> str:
    """The id of the request a parallel sample belongs to (a request's own id: itself)."""
    return request_id.partition(CHILD_SEPARATOR)[0]


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    # Parked: waiting while a KV tier reads its blocks (from disk); admitted once they are in.
    WAITING_FOR_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Something raised for this request alone (fault isolation): it ends, the batch goes on.
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """A request's tokens and progress.

    `num_computed_tokens` counts tokens whose KV is in the cache; it catches up with
    `num_tokens` (prompt + output) one scheduled chunk at a time. A token is sampled
    whenever a step brings it level, so prefill and decode are the same thing.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first (under the "priority" scheduling policy)
    cache_salt: str | None = None  # requests share cached KV only with equal salts
    tenant: str | None = None  # the "fair" policy shares the engine between tenants
    bad_words_token_ids: list[list[int]] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | None = None
    # Sum of the sampled tokens' logprobs; None unless the request asked for logprobs.
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    first_scheduled_time: float | None = None  # time.monotonic() of the first admission
    # Chained hashes of the full blocks of all_token_ids, extended as tokens arrive.
    block_hashes: list[int] = field(default_factory=list)
    # Grammar state when sampling_params.structured_outputs is set (the manager owns it).
    structured_output: Any = None
    # n > 1: whether the scheduler has made the other samples their own requests yet.
    samples_forked: bool = False
    # Speculative decoding: tokens proposed after the last one, to verify in the next step.
    spec_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter it runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # An embedding request (runner="pooling"): it ends with its prefill, sampling nothing.
    pooling_params: PoolingParams | None = None

    @classmethod
    def from_core_request(cls, request: EngineCoreRequest) -> Request:
        """The scheduler's request for one that entered the engine core (waiting, nothing
        computed yet)."""
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            frozenset(request.eos_token_ids),
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            bad_words_token_ids=request.bad_words_token_ids,
            tenant=request.tenant,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
        )

    def fork(self, index: int) -> Request:
        """Parallel sample `index` (n > 1) as a request of its own, forked in the step that
        computes this request's last prompt token: running, with its parent's progress (the
        KV manager shares the blocks), its own seed, and no prompt logprobs (reported once,
        with the parent)."""
        params = self.sampling_params
        return Request(
            child_request_id(self.request_id, index),
            self.prompt_token_ids,
            dataclasses.replace(
                params,
                n=1,
                seed=None if params.seed is None else params.seed + index,
                prompt_logprobs=None,
            ),
            self.eos_token_ids,
            arrival_time=self.arrival_time,
            priority=self.priority,
            cache_salt=self.cache_salt,
            bad_words_token_ids=self.bad_words_token_ids,
            tenant=self.tenant,
            lora_request=self.lora_request,
            status=RequestStatus.RUNNING,
            num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            first_scheduled_time=self.first_scheduled_time,
            block_hashes=list(self.block_hashes),
        )

    @property
    def num_unforked_samples(self) -> int:
        """Parallel samples (n > 1) still to be forked: they run once the first token is due."""
        return 0 if self.samples_forked else self.sampling_params.n - 1

    @property
    def lora_int_id(self) -> int:
        """The adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def cache_namespace(self) -> object:
        """What marks the request's first block in the prefix cache: its salt and its
        adapter (KV computed under one adapter never serves another)."""
        if self.lora_request is None:
            return self.cache_salt
        return (self.cache_salt, self.lora_request.cache_key)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """The tokens at positions [start, end) of prompt + output, without copying both."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        num_prompt = len(prompt)
        if end <= num_prompt:
            return prompt[start:end]
        if start >= num_prompt:
            return output[start - num_prompt : end - num_prompt]
        return prompt[start:] + output[: end - num_prompt]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int, logprob: float | None) -> None:
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprob
