"""The KV tiers' scheduler side as a participant of the scheduling loop: where a waiting
request's blocks come from besides the prefix cache (host memory, disk, a peer), a preempted
request's blocks swapped out, a computed prompt's blocks sent to a peer, each step's moves.

`NoKVTiers` is the participant when no tier is configured: the pool alone."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.kv_block import KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.kv_transfer.core.tier_manager import KVTierManager, TierHit
from pagedllm.kv_transfer.ops import KVTransferOps, KVTransferResult


@dataclass
class Lookup:
    """A waiting request's known blocks: prefix-cache hits, then what the tiers hold past
    them (`tier_hit`). While some are still read from disk the request's status is
    WAITING_FOR_KV: it is admitted later."""

    hits: list[KVCacheBlock]
    num_hit_tokens: int
    tier_hit: TierHit | None = None

    @property
    def num_loaded_tokens(self) -> int:
        return self.tier_hit.num_tokens if self.tier_hit is not None else 0


class NoKVTiers:
    """No tier: a request's known blocks are its prefix-cache hits."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager

    def lookup(self, request: Request) -> Lookup:
        return Lookup(*self.kv_cache_manager.get_computed_blocks(request))

    def load(self, request: Request, lookup: Lookup) -> None:
        """Fill the request's fresh blocks from the tiers before its step runs."""

    def on_preempt(self, request: Request) -> None:
        """Called while the preempted request still holds its blocks."""

    def on_scheduled(self, request: Request, num_computed_before: int) -> None:
        """The request's tokens from `num_computed_before` are in this step."""

    def take_ops(self) -> KVTransferOps | None:
        return None

    def apply_result(self, result: KVTransferResult | None) -> None:
        """The runner's report of the step's moves."""

    def request_finished(self, request_id: str) -> None:
        """The request left the scheduler."""


class KVTierScheduling(NoKVTiers):
    def __init__(self, kv_cache_manager: KVCacheManager, tiers: KVTierManager) -> None:
        super().__init__(kv_cache_manager)
        self.tiers = tiers
        kv_cache_manager.block_pool.on_evict = tiers.on_evict
        kv_cache_manager.on_publish = tiers.on_publish

    def lookup(self, request: Request) -> Lookup:
        """A swapped-out request takes back only its own blocks."""
        kv = self.kv_cache_manager
        swapped = self.tiers.swapped.get(request.request_id)
        if swapped is not None:
            return Lookup([], 0, swapped)
        hits, num_hit_tokens = kv.get_computed_blocks(request)
        kv.update_block_hashes(request)
        return Lookup(hits, num_hit_tokens, self.tiers.find(request, num_hit_tokens))

    def load(self, request: Request, lookup: Lookup) -> None:
        if lookup.tier_hit is not None:
            table = self.kv_cache_manager.get_block_ids(request.request_id)
            self.tiers.load(request.request_id, lookup.tier_hit, table)

    def on_preempt(self, request: Request) -> None:
        """Swap: its blocks go to host memory first."""
        kv = self.kv_cache_manager
        blocks = kv.req_to_blocks.get(request.request_id, [])
        self.tiers.swap_out(request, blocks, kv.block_pool.null_block)

    def on_scheduled(self, request: Request, num_computed_before: int) -> None:
        """A producer sends each prompt's blocks to its peer once the prompt is computed."""
        if not self.tiers.sends:
            return
        if num_computed_before < request.num_prompt_tokens <= request.num_computed_tokens:
            kv = self.kv_cache_manager
            self.tiers.on_prompt_computed(
                request,
                kv.update_block_hashes(request),
                kv.get_block_ids(request.request_id),
                kv.block_pool.null_block.block_id,
            )

    def take_ops(self) -> KVTransferOps | None:
        return self.tiers.take_ops()

    def apply_result(self, result: KVTransferResult | None) -> None:
        self.tiers.apply_result(result)

    def request_finished(self, request_id: str) -> None:
        self.tiers.request_finished(request_id)


def kv_tier_participant(kv_cache_manager: KVCacheManager, tiers: KVTierManager | None) -> NoKVTiers:
    if tiers is None:
        return NoKVTiers(kv_cache_manager)
    return KVTierScheduling(kv_cache_manager, tiers)
