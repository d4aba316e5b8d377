"""The prefix cache: which full KV blocks hold which token prefix.

Invariants (each is asserted by `KVCacheManager.check_integrity` or a test):
- A block is in the cache exactly when `block.cache_key` is set; `len(cache)` counts them.
- A lookup only returns a block whose token ids and extra keys equal the request's and
  whose parent entry is the very block the request matched before it (same block id and
  same cache generation). By induction from the first block, a hit covers exactly the
  request's prefix: a hash collision can never serve wrong KV.
- Evicting bumps the block's generation, so blocks cached as its children can never
  match again through it; `evict` on a block that is not cached does nothing.
- Cached blocks nobody holds stay in the free queue (LRU order) and are evicted only when
  a fresh block is needed.
"""

from __future__ import annotations

from pagedllm.core.hashing import BlockHash, ExtraKeys
from pagedllm.core.kv_block import BlockCacheKey, KVCacheBlock, entry_id


class PrefixCache:
    def __init__(self) -> None:
        # Several blocks may share a hash (a collision, or the same prefix computed twice).
        self._blocks: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self._num_blocks = 0

    def __len__(self) -> int:
        return self._num_blocks

    def lookup(
        self,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        extra_keys: ExtraKeys,
        parent: KVCacheBlock | None,
    ) -> KVCacheBlock | None:
        wanted = BlockCacheKey(block_hash, token_ids, extra_keys, entry_id(parent))
        for block in self._blocks.get(block_hash, {}).values():
            if block.cache_key == wanted:
                return block
        return None

    def insert(
        self,
        block: KVCacheBlock,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        extra_keys: ExtraKeys,
        parent: KVCacheBlock | None,
    ) -> None:
        if block.cache_key is not None:
            raise ValueError(f"{block} is already cached")
        block.cache_key = BlockCacheKey(block_hash, token_ids, extra_keys, entry_id(parent))
        self._blocks.setdefault(block_hash, {})[block.block_id] = block
        self._num_blocks += 1

    def evict(self, block: KVCacheBlock) -> None:
        key = block.cache_key
        if key is None:
            return
        same_hash = self._blocks[key.block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self._blocks[key.block_hash]
        block.cache_key = None
        block.tier_key = None
        block.generation += 1
        self._num_blocks -= 1

    def cached_blocks(self) -> list[KVCacheBlock]:
        return [block for blocks in self._blocks.values() for block in blocks.values()]
