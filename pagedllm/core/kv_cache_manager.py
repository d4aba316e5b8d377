"""`KVCacheManager`: block tables per request, prefix-cache lookups, taking and returning blocks.

A model's layers may form several KV cache groups (`config.KVCacheGroups`: full-attention
layers and sliding-window layers keep separate tables). A request's blocks are then one flat
list, interleaved by group: logical block i of group g is entry `i * num_groups + g`. The
runner splits the list the same way. A windowed group frees the blocks its window has left
behind as the request advances; their entries become the null block, which no kernel reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.core import hashing
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.request import Request
from pagedllm.utils import cdiv


@dataclass
class KVAllocation:
    """What `allocate_slots` took for a request's next tokens.

    `block_copies` is set when the request was about to write into a partly filled block that
    other requests share (parallel samples): the request got a copy of it (copy-on-write; one
    per KV cache group), the runner must copy each (source, destination) before the forward,
    and the request's block table changed in place, so it is sent whole.
    """

    new_blocks: list[KVCacheBlock] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

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
    """Owns the block pool and one block table (a list of blocks) per request.

    `group_windows` has one entry per KV cache group: its sliding window in tokens, or None
    for full attention (the default: one full group).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        group_windows: tuple[int | None, ...] = (None,),
        stable_hashes: bool = False,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading logical blocks of each request are already in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Windowed groups: how many leading logical blocks of each request were freed.
        self.num_dropped_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # KV tiers key blocks by hashes every process computes alike (`hashing`).
        self.stable_hashes = stable_hashes
        # KV tiers: told of each block published to the prefix cache (block, its chained
        # hash, its group, its token ids).
        self.on_publish: Callable[[KVCacheBlock, int, int, tuple[int, ...]], None] | None = None

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
        self.update_block_hashes(request)
        token_ids = request.all_token_ids
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for index, block_hash in enumerate(request.block_hashes[:max_blocks]):
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            # A logical block is a hit only when every group has it cached.
            row = []
            for group in range(self.num_groups):
                parent = hits[(index - 1) * self.num_groups + group] if index else None
                block = self.block_pool.prefix_cache.lookup(
                    block_hash, tokens, self._extra_keys(request, index, group), parent
                )
                if block is None:
                    break
                row.append(block)
                hits.append(block)
            if len(row) < self.num_groups:
                del hits[len(hits) - len(row) :]
                break
        return hits, len(hits) // self.num_groups * self.block_size

    def _extra_keys(self, request: Request, index: int, group: int) -> hashing.ExtraKeys:
        """A cached block proves its group too: groups hold different layers' KV."""
        extra_keys = hashing.block_extra_keys(index, request.cache_namespace)
        return extra_keys if group == 0 else (*(extra_keys or ()), ("kv_group", group))

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
        num_lookahead_tokens: int = 0,
    ) -> KVAllocation | None:
        """Take prefix-cache hits and fresh blocks for `num_new_tokens` more tokens, and for
        `num_lookahead_tokens` slots after them (a draft model's proposals; never cached).

        Returns the fresh blocks (and the copies-on-write made, if any), or None (and takes
        nothing) if too few are free. Blocks that windowed groups no longer need are freed
        first, whatever the outcome: the request never reads them again.
        """
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_tokens_after, num_new_blocks = self._growth(
            request, blocks, computed, num_new_tokens + num_lookahead_tokens
        )
        num_tokens_after -= num_lookahead_tokens
        num_computed_after = self._num_computed_after(request, computed)
        self._drop_outside_windows(request.request_id, blocks, num_computed_after)
        shared = self._shared_partial_blocks(request, blocks)
        needed = self.num_blocks_to_allocate(
            request, num_new_tokens + num_lookahead_tokens, computed
        )
        if needed > self.num_free_blocks:
            return None
        block_copies = [self._copy_on_write(blocks, index) for index in shared]
        computed = self._without_dropped(blocks, computed, num_computed_after)
        self.block_pool.touch(b for b in computed if b is not self.block_pool.null_block)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks = self.req_to_blocks.setdefault(request.request_id, blocks)
        blocks.extend(computed)
        blocks.extend(new_blocks)
        if self.enable_caching:
            num_hits = self._num_logical(computed)
            self._cache_full_blocks(request, blocks, num_hits, num_tokens_after)
        return KVAllocation(new_blocks, block_copies)

    def _num_logical(self, blocks: list[KVCacheBlock]) -> int:
        return len(blocks) // self.num_groups

    def _num_computed_after(self, request: Request, computed: list[KVCacheBlock]) -> int:
        """Tokens computed once the prefix-cache hits `computed` are taken."""
        return request.num_computed_tokens + self._num_logical(computed) * self.block_size

    def _growth(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        computed: list[KVCacheBlock],
        num_new_tokens: int,
    ) -> tuple[int, int]:
        """(tokens the request will hold, fresh blocks it needs for them)."""
        num_tokens_after = self._num_computed_after(request, computed) + num_new_tokens
        num_logical = cdiv(num_tokens_after, self.block_size) - self._num_logical(blocks)
        num_logical -= self._num_logical(computed)
        return num_tokens_after, max(0, num_logical) * self.num_groups

    def _first_needed_block(self, group: int, num_computed_tokens: int) -> int:
        """The first logical block a group still reads once `num_computed_tokens` are
        computed: with a window, the next query (at that position) sees window - 1 keys back."""
        window = self.group_windows[group]
        if window is None:
            return 0
        return max(0, num_computed_tokens - window + 1) // self.block_size

    def _drop_outside_windows(
        self, request_id: str, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> None:
        """Free the blocks of windowed groups that lie wholly before their windows."""
        windowed = [g for g, w in enumerate(self.group_windows) if w is not None]
        if not windowed or not blocks:
            return
        first = self.num_dropped_blocks.get(request_id, 0)
        null = self.block_pool.null_block
        freed = []
        ends = {g: self._first_needed_block(g, num_computed_tokens) for g in windowed}
        for group, end in ends.items():
            for index in range(first, min(end, self._num_logical(blocks))):
                entry = index * self.num_groups + group
                if blocks[entry] is not null:
                    freed.append(blocks[entry])
                    blocks[entry] = null
        self.num_dropped_blocks[request_id] = max(
            first, min(min(ends.values()), self._num_logical(blocks))
        )
        self.block_pool.free_blocks(reversed(freed))

    def _without_dropped(
        self, blocks: list[KVCacheBlock], computed: list[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Prefix-cache hits, with those a windowed group would free at once replaced by the
        null block (never taken)."""
        if all(w is None for w in self.group_windows):
            return computed
        offset = self._num_logical(blocks)
        kept = list(computed)
        for entry in range(len(kept)):
            index, group = divmod(entry, self.num_groups)
            if offset + index < self._first_needed_block(group, num_computed_tokens):
                kept[entry] = self.block_pool.null_block
        return kept

    def num_blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> int:
        """Free blocks `allocate_slots` would take for these tokens: fresh ones, copies-on-write,
        and prefix-cache hits that sit in the free queue (taking them makes them held)."""
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        _, num_new_blocks = self._growth(request, blocks, computed, num_new_tokens)
        kept = self._without_dropped(blocks, computed, self._num_computed_after(request, computed))
        null = self.block_pool.null_block
        num_free_hits = sum(1 for block in kept if block is not null and block.ref_cnt == 0)
        num_copies = len(self._shared_partial_blocks(request, blocks))
        return num_new_blocks + num_copies + num_free_hits

    def _shared_partial_blocks(self, request: Request, blocks: list[KVCacheBlock]) -> list[int]:
        """Entries (one per group) of the logical block the next token lands in, where it is
        partly filled and shared."""
        index, offset = divmod(request.num_computed_tokens, self.block_size)
        if not offset:
            return []
        entries = range(index * self.num_groups, (index + 1) * self.num_groups)
        return [e for e in entries if e < len(blocks) and blocks[e].ref_cnt > 1]

    def _copy_on_write(self, blocks: list[KVCacheBlock], index: int) -> tuple[int, int]:
        """Give the request its own copy of a shared block before it writes into it."""
        (copy,) = self.block_pool.get_new_blocks(1)
        shared = blocks[index]
        blocks[index] = copy
        self.block_pool.free_blocks([shared])
        return shared.block_id, copy.block_id

    def trim(self, request: Request, num_lookahead_tokens: int = 0) -> bool:
        """Speculative decoding: return the blocks past the request's computed tokens (and
        `num_lookahead_tokens` slots after them) once rejected drafts no longer count. They
        were never published to the prefix cache: only verified tokens are. True if any
        block was freed (the request's table changed)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return False
        num_needed = request.num_computed_tokens + num_lookahead_tokens
        keep = cdiv(num_needed, self.block_size) * self.num_groups
        if len(blocks) <= keep:
            return False
        surplus = blocks[keep:]
        del blocks[keep:]
        null = self.block_pool.null_block
        self.block_pool.free_blocks(b for b in reversed(surplus) if b is not null)
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (one more reference each)."""
        blocks = list(self.req_to_blocks.get(parent.request_id, []))
        self.block_pool.touch(b for b in blocks if b is not self.block_pool.null_block)
        self.req_to_blocks[child.request_id] = blocks
        num_prompt_blocks = parent.num_prompt_tokens // self.block_size
        self.num_cached_blocks[child.request_id] = min(
            self.num_cached_blocks.get(parent.request_id, 0), num_prompt_blocks
        )
        if parent.request_id in self.num_dropped_blocks:
            self.num_dropped_blocks[child.request_id] = self.num_dropped_blocks[parent.request_id]

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
        self.update_block_hashes(request)
        token_ids = request.all_token_ids
        null = self.block_pool.null_block
        for index in range(first, num_full):
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            for group in range(self.num_groups):
                entry = index * self.num_groups + group
                parent = blocks[entry - self.num_groups] if index else None
                # A window that already passed the parent broke the chain: no lookup can
                # reach this block through it, so it is not published.
                if blocks[entry] is null or parent is null:
                    continue
                self.block_pool.prefix_cache.insert(
                    blocks[entry],
                    request.block_hashes[index],
                    tokens,
                    self._extra_keys(request, index, group),
                    parent,
                )
                if self.on_publish is not None:
                    self.on_publish(blocks[entry], request.block_hashes[index], group, tokens)

    def update_block_hashes(self, request: Request) -> list[int]:
        """The request's chained hashes of every full block, brought up to date."""
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            hashing.extend_block_hashes(
                request.block_hashes,
                request.all_token_ids,
                self.block_size,
                request.cache_namespace,
                self.stable_hashes,
            )
        return request.block_hashes

    def free(self, request: Request) -> None:
        """Return every block of `request`. Tail blocks go first so they are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_dropped_blocks.pop(request.request_id, None)
        null = self.block_pool.null_block
        self.block_pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's flat block table (interleaved by group; freed entries are 0)."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds (its table less the entries its windows freed)."""
        null = self.block_pool.null_block
        return sum(1 for block in self.req_to_blocks.get(request_id, ()) if block is not null)

    def check_integrity(self) -> None:
        """Assert free + held blocks == usable blocks, ref counts match holders, cache is sound."""
        holders: dict[int, int] = {}
        null = self.block_pool.null_block
        for blocks in self.req_to_blocks.values():
            assert len(blocks) % self.num_groups == 0, "a table of whole logical blocks"
            for block in blocks:
                if block is not null:
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
