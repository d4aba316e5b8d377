"""The KV block pool: every physical KV block, their reference counts and the free-block queue.

Block 0 is the null block: never handed out, it pads block tables so the attention
kernels can index them without a branch. Free blocks may still hold cached KV (see
`prefix_cache.py`): they are evicted from the cache only when handed out again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedllm.core.kv_block import KVCacheBlock
from pagedllm.core.prefix_cache import PrefixCache


class FreeKVCacheBlockQueue:
    """Free blocks as an intrusive doubly linked list between two sentinels.

    The front is the next block handed out and the back the most recently freed one, so
    the order is also the least-recently-used eviction order a prefix cache needs.
    Removing a block from the middle is O(1) because each block carries its own links;
    a `deque.remove` would be O(n).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids front to back (for tests and integrity checks)."""
        ids = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """All `num_blocks` blocks; hands out fresh ones and takes back released ones."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.prefix_cache = PrefixCache()
        # KV tiers: told of each cached block just before it is evicted to be handed out.
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.prefix_cache)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Blocks from the front of the free queue (least recently used), evicted if cached."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if self.on_evict is not None and block.cache_key is not None:
                self.on_evict(block)
            self.prefix_cache.evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free one leaves the free queue in O(1)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is held."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.prefix_cache.cached_blocks():
            self.prefix_cache.evict(block)
        return True

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; a block nobody holds goes to the back of the queue."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more times than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
