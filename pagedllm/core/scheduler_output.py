"""What the model runner needs for one step: new requests whole, running ones as diffs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.messages import TokenLogprob
from pagedllm.core.request import Request
from pagedllm.kv_transfer.ops import KVTransferOps, KVTransferResult
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: everything it needs to hold the request's state."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    bad_words_token_ids: list[list[int]] | None = None
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None

    @classmethod
    def of(cls, request: Request, block_ids: list[int]) -> NewRequestData:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            eos_token_ids=request.eos_token_ids,
            bad_words_token_ids=request.bad_words_token_ids,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
        )


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed since its last step.

    A request resumed after preemption, or whose table changed by copy-on-write, gets its
    whole block table (`new_block_ids` replaces its blocks); otherwise they are appended.

    `token_ids` (only when several ranks run the model: `SchedulerConfig.send_token_ids`)
    are the token ids from `num_computed_tokens` on that this step runs, for the ranks that
    do not sample and so never saw the last sampled token; a request resumed after
    preemption gets all its tokens from there to its last, so those ranks know where it ends.
    """

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed_from_preemption: bool = False
    token_ids: list[int] | None = None
    # True only when the request was preempted since its last step (its KV is recomputed
    # in new blocks); `resumed_from_preemption` is also set for any table sent whole.
    preempted: bool = False


@dataclass
class KVTableCheck:
    """Debug mode only (`PAGEDLLM_DEBUG=1`): what every rank's KV cache must agree with once
    it has applied the step's updates. The runner checks that its KV tensors hold
    `num_blocks` blocks, that its block table of every running request equals the
    scheduler's, and that none of those blocks is the null block or outside the pool."""

    num_blocks: int
    null_block_id: int
    # Every running request's block ids, as the scheduler's KV cache manager holds them.
    block_tables: dict[str, list[int]]


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # Request id -> tokens to run this step, in the order the batch is laid out.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests that ended since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Copy-on-write: copy block `source` to block `destination` before the forward.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Structured output: allowed-token bitmask rows (int32 words) for the constrained
    # requests that sample this step, and each one's row.
    grammar_bitmask: Any = None
    grammar_rows: dict[str, int] = field(default_factory=dict)
    # Parallel sampling: parent id -> the samples forked this step (new requests that are
    # not scheduled; each draws its first token from its parent's logits, with its own seed).
    forked_samples: dict[str, list[str]] = field(default_factory=dict)
    # Debug mode: the tables every rank checks its own against (None, and no cost, otherwise).
    kv_check: KVTableCheck | None = None
    # Speculative decoding: request id -> the draft tokens it runs after its last token this
    # step (they are counted in `num_scheduled_tokens`); the runner verifies them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # KV tiers: blocks to move between the pool, host memory, disk and a peer this step.
    kv_transfer: KVTransferOps | None = None
    # Speculative decoding: whether this step is small enough to speculate
    # (`disable_by_batch_size` against the running requests, as the scheduler counts them).
    speculating: bool = True

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class ModelRunnerOutput:
    """The tokens (and logprobs) of each request that was due tokens this step: one, or with
    speculative decoding the accepted drafts and the token after them."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    # For requests that asked for logprobs: each sampled token's rank and alternatives.
    sample_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # For requests that asked for prompt_logprobs: prompt index -> logprob of that prompt
    # token given the tokens before it, for the positions this step computed.
    prompt_logprobs: dict[str, dict[int, TokenLogprob]] = field(default_factory=dict)
    # Fault isolation: requests whose own stage raised this step (request id -> what raised,
    # in one line). They sampled nothing; the scheduler ends them with finish_reason "error".
    failed_requests: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: the tokens proposed to follow each request's last sampled token.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # KV tiers: disk reads and sends that ended.
    kv_transfer: KVTransferResult | None = None
    # runner="pooling": the vector of each request whose prompt this step finished.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
