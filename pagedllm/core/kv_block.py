"""One physical KV block's bookkeeping record, and the key that proves what a cached block holds.

A leaf of `core/`: the pool (`block_pool.py`) links these records into its free queue and the
prefix cache (`prefix_cache.py`) stamps them with cache keys; neither needs the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.hashing import BlockHash, ExtraKeys

# (block_id, generation) of a cache entry.
EntryId = tuple[int, int]


@dataclass(frozen=True)
class BlockCacheKey:
    """What a cached block proves about itself."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]
    extra_keys: ExtraKeys
    parent: EntryId | None


class KVCacheBlock:
    """One physical block's bookkeeping; `prev_free`/`next_free` link it into the free queue."""

    __slots__ = (
        "block_id",
        "cache_key",
        "generation",
        "next_free",
        "prev_free",
        "ref_cnt",
        "tier_key",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.cache_key: BlockCacheKey | None = None
        self.generation = 0  # bumped at each eviction from the prefix cache
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        # With KV tiers: the key (`kv_transfer.ops.block_key`) its cached KV goes by.
        self.tier_key: str | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


def entry_id(block: KVCacheBlock | None) -> EntryId | None:
    return None if block is None else (block.block_id, block.generation)
