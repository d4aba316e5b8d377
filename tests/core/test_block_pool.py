"""Block pool and free-block queue on tiny pools: exact ids, queue order, reference counts."""

import pytest

from pagedllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def test_null_block_is_reserved_and_rest_are_free_in_order():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4]
    assert pool.num_free_blocks == 4


def test_get_new_blocks_takes_from_the_front_with_ref_count_one():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.free_block_queue.block_ids() == [3, 4]


def test_freed_blocks_go_to_the_back_in_lru_order():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([b])
    pool.free_blocks([a])
    assert pool.free_block_queue.block_ids() == [4, 5, 2, 1]
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [4, 5, 2]
    assert c.ref_cnt == 1


def test_shared_block_returns_only_when_last_reference_drops():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # a second holder
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1 and block.ref_cnt == 1
    pool.free_blocks([block])
    assert pool.free_block_queue.block_ids() == [2, 1]


def test_double_free_and_over_allocation_are_refused():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="freed more times"):
        pool.free_blocks([block])
    with pytest.raises(ValueError, match="only 2 left"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_queue_removes_from_the_middle_in_constant_time():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert queue.num_free_blocks == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert queue.block_ids() == [1, 3]
    queue.append(blocks[4])
    assert queue.popleft() is blocks[1]
    assert queue.block_ids() == [3, 4]


def test_queue_refuses_removing_a_block_not_in_it():
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeKVCacheBlockQueue(blocks[:1])
    with pytest.raises(ValueError):
        queue.remove(blocks[1])
    with pytest.raises(ValueError):
        queue.append(blocks[0])
    queue.popleft()
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()


def test_usage_counts_held_blocks():
    pool = BlockPool(5)
    assert pool.usage == 0.0
    pool.get_new_blocks(2)
    assert pool.usage == 0.5
