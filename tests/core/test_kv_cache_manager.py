"""KV cache manager on tiny pools: allocate_slots / free with exact block ids and no leaks."""

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt_tokens: int) -> Request:
    return Request(request_id, list(range(num_prompt_tokens)), SamplingParams())


@pytest.fixture
def manager():
    kv = KVCacheManager(num_blocks=9, block_size=4)
    yield kv
    # Every test ends with every request freed: all blocks are back.
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_allocate_rounds_up_to_whole_blocks(manager):
    request = make_request("a", 10)
    blocks = manager.allocate_slots(request, 10).new_blocks
    assert [b.block_id for b in blocks] == [1, 2, 3]
    manager.free(request)


def test_allocate_only_what_the_next_tokens_need(manager):
    request = make_request("a", 6)
    manager.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 1).new_blocks == []  # slot 7 of block 2 is free
    request.num_computed_tokens = 7
    assert manager.allocate_slots(request, 1).new_blocks == []
    request.num_computed_tokens = 8
    assert [b.block_id for b in manager.allocate_slots(request, 1).new_blocks] == [3]
    assert manager.get_block_ids("a") == [1, 2, 3]
    manager.free(request)


def test_chunked_allocation_extends_the_table(manager):
    request = make_request("a", 13)
    manager.allocate_slots(request, 5)
    request.num_computed_tokens = 5
    manager.allocate_slots(request, 8)
    assert manager.get_block_ids("a") == [1, 2, 3, 4]
    manager.free(request)


def test_shortage_returns_none_and_takes_nothing(manager):
    big, small = make_request("big", 28), make_request("small", 8)
    assert len(manager.allocate_slots(big, 28).new_blocks) == 7
    assert manager.allocate_slots(small, 8) is None
    assert manager.num_free_blocks == 1
    assert manager.get_block_ids("small") == []
    manager.free(big)
    manager.free(small)


def test_free_returns_tail_first_and_blocks_are_reused(manager):
    a, b = make_request("a", 8), make_request("b", 4)
    manager.allocate_slots(a, 8)
    manager.allocate_slots(b, 4)
    manager.free(a)
    queue = manager.block_pool.free_block_queue.block_ids()
    assert queue == [4, 5, 6, 7, 8, 2, 1]
    manager.check_integrity()
    c = make_request("c", 24)
    assert [blk.block_id for blk in manager.allocate_slots(c, 24).new_blocks] == [4, 5, 6, 7, 8, 2]
    manager.free(b)
    manager.free(c)


def test_integrity_check_catches_a_leak():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.block_pool.get_new_blocks(1)  # taken, but no request holds it
    with pytest.raises(AssertionError):
        kv.check_integrity()
