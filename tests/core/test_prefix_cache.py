"""Prefix caching on tiny pools: exact block ids, LRU eviction, revival, salts and collisions."""

import pytest

from pagedllm.core import hashing
from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.prefix_cache import PrefixCache
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id, token_ids, cache_salt=None):
    return Request(request_id, list(token_ids), SamplingParams(), cache_salt=cache_salt)


def admit(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """What the scheduler does at admission: take the hits, allocate the rest, compute it all."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    new_blocks = kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return [b.block_id for b in hits], num_hit_tokens


@pytest.fixture
def kv():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    yield manager
    manager.check_integrity()


def test_second_request_reuses_a_three_block_prefix(kv):
    a = make_request("a", range(14))  # blocks 1-3 full, block 4 partial
    assert admit(kv, a) == ([], 0)
    assert kv.get_block_ids("a") == [1, 2, 3, 4]
    b = make_request("b", [*range(12), 100, 101, 102])
    assert admit(kv, b) == ([1, 2, 3], 12)
    assert kv.get_block_ids("b") == [1, 2, 3, 5]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    kv.free(a)
    kv.free(b)


def test_partial_last_block_is_never_shared(kv):
    a = make_request("a", range(14))
    admit(kv, a)
    assert kv.block_pool.blocks[4].cache_key is None
    same = make_request("same", range(14))
    assert admit(kv, same) == ([1, 2, 3], 12)  # block 4's two tokens are recomputed
    assert kv.get_block_ids("same")[3] != 4
    kv.free(a)
    kv.free(same)


def test_last_token_is_always_recomputed(kv):
    a = make_request("a", range(12))
    admit(kv, a)
    exact = make_request("exact", range(12))
    hits, num_hit_tokens = kv.get_computed_blocks(exact)
    assert [b.block_id for b in hits] == [1, 2] and num_hit_tokens == 8
    kv.free(a)


def test_freed_cached_blocks_are_evicted_in_lru_order(kv):
    a, b = make_request("a", range(8)), make_request("b", range(50, 58))
    admit(kv, a)  # blocks 1, 2
    admit(kv, b)  # blocks 3, 4
    kv.free(b)
    kv.free(a)
    queue = kv.block_pool.free_block_queue.block_ids()
    assert queue == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]  # tail blocks first within a request
    assert kv.block_pool.num_cached_blocks == 4
    c = make_request("c", range(100, 128))  # 7 blocks: the 6 never-used ones, then block 4
    admit(kv, c)
    assert kv.get_block_ids("c") == [5, 6, 7, 8, 9, 10, 4]
    assert kv.block_pool.blocks[4].cache_key is not None  # re-cached with c's tokens
    assert kv.block_pool.num_cached_blocks == 4 - 1 + 7
    b_again = make_request("b2", range(50, 60))
    assert admit(kv, b_again) == ([3], 4)  # block 4 of b was evicted; block 3 survived
    kv.free(c)
    kv.free(b_again)


def test_a_hit_revives_a_free_cached_block(kv):
    a = make_request("a", range(9))
    admit(kv, a)
    kv.free(a)
    num_free = kv.num_free_blocks
    b = make_request("b", range(10))
    assert admit(kv, b) == ([1, 2], 8)
    assert 1 not in kv.block_pool.free_block_queue.block_ids()
    assert kv.block_pool.blocks[1].ref_cnt == 1
    assert kv.num_free_blocks == num_free - 3  # two revived, one fresh
    kv.free(b)


def test_different_cache_salts_share_nothing():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", range(12), cache_salt="tenant-1"))
    assert admit(kv, make_request("b", range(13), cache_salt="tenant-2")) == ([], 0)
    assert admit(kv, make_request("c", range(13))) == ([], 0)
    assert admit(kv, make_request("d", range(13), cache_salt="tenant-1")) == ([1, 2, 3], 12)
    for request_id in "abcd":
        kv.free(make_request(request_id, []))
    kv.check_integrity()


def test_constant_hash_never_serves_a_wrong_prefix(kv, monkeypatch):
    monkeypatch.setattr(hashing, "hash_block_tokens", lambda *args: 7)
    x, y, z1, z2 = [1] * 4, [2] * 4, [3] * 4, [4] * 4
    admit(kv, make_request("r1", [*x, *z1, 9]))  # caches X -> Z1
    admit(kv, make_request("r2", [*y, *z2, 9]))  # caches Y -> Z2
    # Z2 is cached with the same (constant) hash and parent hash as X's child would have,
    # but its parent is Y: only X's block may be reused.
    hits, num_hit_tokens = kv.get_computed_blocks(make_request("r3", [*x, *z2, 9]))
    assert [b.block_id for b in hits] == [1] and num_hit_tokens == 4
    hits, _ = kv.get_computed_blocks(make_request("r4", [*x, *z1, 9]))
    assert [b.block_id for b in hits] == [1, 2]
    kv.free(make_request("r1", []))
    kv.free(make_request("r2", []))


def test_evicted_parent_invalidates_its_children():
    cache = PrefixCache()
    parent, child = KVCacheBlock(1), KVCacheBlock(2)
    cache.insert(parent, 11, (0, 1), None, None)
    cache.insert(child, 22, (2, 3), None, parent)
    assert cache.lookup(22, (2, 3), None, parent) is child
    cache.evict(parent)
    assert parent.generation == 1 and parent.cache_key is None and len(cache) == 1
    # The same tokens cached again in the same physical block are a new entry: the
    # child's KV was computed after the old one and is not reachable through it.
    cache.insert(parent, 11, (0, 1), None, None)
    assert cache.lookup(11, (0, 1), None, None) is parent
    assert cache.lookup(22, (2, 3), None, parent) is None
    cache.evict(KVCacheBlock(3))  # not cached: nothing happens
    assert len(cache) == 2


def test_reset_prefix_cache_refuses_while_blocks_are_held(kv):
    a = make_request("a", range(9))
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    assert kv.block_pool.num_cached_blocks == 2
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.block_pool.num_cached_blocks == 0
    assert admit(kv, make_request("b", range(9))) == ([], 0)
    kv.free(make_request("b", []))


def test_caching_off_shares_nothing():
    kv = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE, enable_caching=False)
    admit(kv, make_request("a", range(9)))
    assert admit(kv, make_request("b", range(9))) == ([], 0)
    assert kv.block_pool.num_cached_blocks == 0
    kv.check_integrity()


def test_lookup_counters(kv):
    a = make_request("a", range(9))
    admit(kv, a)
    kv.record_prefix_lookup(9, 0)
    b = make_request("b", range(10))
    _, hit = admit(kv, b)
    kv.record_prefix_lookup(10, hit)
    stats = kv.prefix_cache_stats
    assert (stats.queries, stats.hits) == (19, 8)
    assert stats.hit_rate == pytest.approx(8 / 19)
    kv.free(a)
    kv.free(b)
