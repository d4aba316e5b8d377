"""`KVCacheManager`: block tables per request, prefix-cache lookups, taking and returning blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core import hashing
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.request import Request
from pagedllm.utils import cdiv


@dataclass
class KVAllocation:
    """What `allocate_slots` took for a request's next tokens.

    `block_copy` is set when the request was about to write into a partly filled block that
    other requests share (parallel samples): the request got a copy of it (copy-on-write),
    the runner must copy (source, destination) before the forward, and the request's block
    table changed in place, so it is sent whole.
    """

    new_blocks: list[KVCacheBlock] = field(default_factory=list)
    block_copy: tuple[int, int] | None = None

    @property
    def new_block_ids(self) -> list[int]:
        return [block.block_id for block in self.new_blocks]


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens since start-up."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Owns the block pool and one block table (a list of blocks) per request."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's tokens: (blocks, number of tokens).

        The last token is never taken from the cache: the step must compute it to have
        logits to sample from. Requests asking for prompt logprobs get no hits.
        """
        # Prompt logprobs need logits at every prompt position, so such requests skip hits.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        token_ids = request.all_token_ids
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for index, block_hash in enumerate(request.block_hashes[:max_blocks]):
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            extra_keys = hashing.block_extra_keys(index, request.cache_salt)
            parent = hits[-1] if hits else None
            block = self.block_pool.prefix_cache.lookup(block_hash, tokens, extra_keys, parent)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (a request waiting for room is not recounted)."""
        if self.enable_caching:
            self.prefix_cache_stats.queries += num_query_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> KVAllocation | None:
        """Take prefix-cache hits and fresh blocks for `num_new_tokens` more tokens.

        Returns the fresh blocks (and the copy-on-write made, if any), or None (and takes
        nothing) if too few are free.
        """
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_tokens_after, num_new_blocks = self._growth(request, blocks, computed, num_new_tokens)
        shared_index = self._shared_partial_block(request, blocks)
        if self.num_blocks_to_allocate(request, num_new_tokens, computed) > self.num_free_blocks:
            return None
        block_copy = None if shared_index is None else self._copy_on_write(blocks, shared_index)
        self.block_pool.touch(computed)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks = self.req_to_blocks.setdefault(request.request_id, blocks)
        blocks.extend(computed)
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, len(computed), num_tokens_after)
        return KVAllocation(new_blocks, block_copy)

    def _growth(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        computed: list[KVCacheBlock],
        num_new_tokens: int,
    ) -> tuple[int, int]:
        """(tokens the request will hold, fresh blocks it needs for them)."""
        num_tokens_after = (
            request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        )
        num_blocks = cdiv(num_tokens_after, self.block_size) - len(blocks) - len(computed)
        return num_tokens_after, max(0, num_blocks)

    def num_blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> int:
        """Free blocks `allocate_slots` would take for these tokens: fresh ones, a copy-on-write,
        and prefix-cache hits that sit in the free queue (taking them makes them held)."""
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        _, num_new_blocks = self._growth(request, blocks, computed, num_new_tokens)
        num_free_hits = sum(1 for block in computed if block.ref_cnt == 0)
        num_copies = 0 if self._shared_partial_block(request, blocks) is None else 1
        return num_new_blocks + num_copies + num_free_hits

    def _shared_partial_block(self, request: Request, blocks: list[KVCacheBlock]) -> int | None:
        """Index of the block the next token lands in, if it is partly filled and shared."""
        index, offset = divmod(request.num_computed_tokens, self.block_size)
        if offset and index < len(blocks) and blocks[index].ref_cnt > 1:
            return index
        return None

    def _copy_on_write(self, blocks: list[KVCacheBlock], index: int) -> tuple[int, int]:
        """Give the request its own copy of a shared block before it writes into it."""
        (copy,) = self.block_pool.get_new_blocks(1)
        shared = blocks[index]
        blocks[index] = copy
        self.block_pool.free_blocks([shared])
        return shared.block_id, copy.block_id

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (one more reference each)."""
        blocks = list(self.req_to_blocks.get(parent.request_id, []))
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = blocks
        num_prompt_blocks = parent.num_prompt_tokens // self.block_size
        self.num_cached_blocks[child.request_id] = min(
            self.num_cached_blocks.get(parent.request_id, 0), num_prompt_blocks
        )

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_hits: int, num_tokens: int
    ) -> None:
        """Publish the blocks that this step fills (their KV is written in the same step)."""
        request_id = request.request_id
        first = max(self.num_cached_blocks.get(request_id, 0), num_hits)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        self.num_cached_blocks[request_id] = max(first, num_full)
        if num_full <= first:
            return
        self._update_block_hashes(request)
        token_ids = request.all_token_ids
        for index in range(first, num_full):
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            parent = blocks[index - 1] if index else None
            self.block_pool.prefix_cache.insert(
                blocks[index],
                request.block_hashes[index],
                tokens,
                hashing.block_extra_keys(index, request.cache_salt),
                parent,
            )

    def _update_block_hashes(self, request: Request) -> None:
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            hashing.extend_block_hashes(
                request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt
            )

    def free(self, request: Request) -> None:
        """Return every block of `request`. Tail blocks go first so they are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def check_integrity(self) -> None:
        """Assert free + held blocks == usable blocks, ref counts match holders, cache is sound."""
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
        cached = pool.prefix_cache.cached_blocks()
        assert len(cached) == pool.num_cached_blocks
        assert sum(1 for b in pool.blocks if b.cache_key is not None) == len(cached)
        assert pool.null_block.cache_key is None and pool.null_block.ref_cnt == 0
