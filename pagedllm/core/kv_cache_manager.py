"""`KVCacheManager`: which blocks each request holds, and taking or returning them."""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the block pool and one block table (a list of blocks) per request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int) -> int:
        num_required = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, num_required - len(self.req_to_blocks.get(request.request_id, ())))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """New blocks for `num_new_tokens` more tokens; None (nothing taken) if too few are free."""
        num_new_blocks = self.num_blocks_to_allocate(request, num_new_tokens)
        if num_new_blocks > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        self.req_to_blocks.setdefault(request.request_id, []).extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Return every block of `request`. Tail blocks go first so they are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def check_integrity(self) -> None:
        """Assert free + held blocks == usable blocks and each ref count matches its holders."""
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        pool = self.block_pool
        assert len(holders) + pool.num_free_blocks == pool.num_usable_blocks, (
            f"{len(holders)} held + {pool.num_free_blocks} free != {pool.num_usable_blocks} blocks"
        )
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0), f"{block} has wrong ref_cnt"
