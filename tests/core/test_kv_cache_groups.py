"""KV cache groups on tiny pools: windowed groups free the blocks their windows left behind,
full groups keep theirs, prefix hits stay per group, and everything returns to the pool."""

import pytest

from pagedllm.config import KVCacheGroup, KVCacheGroups, kv_cache_groups
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv

BLOCK_SIZE = 4
WINDOW = 10  # a query sees itself and the 9 keys before it


def make_request(request_id: str, num_prompt_tokens: int, offset: int = 0) -> Request:
    tokens = [offset + i for i in range(num_prompt_tokens)]
    return Request(request_id, tokens, SamplingParams(max_tokens=1000))


def decode(kv: KVCacheManager, request: Request, num_steps: int) -> None:
    """Run the prompt in one step, then `num_steps` decode steps (one token each)."""
    assert kv.allocate_slots(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    for step in range(num_steps):
        request.output_token_ids.append(1000 + step)
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1


def held_per_group(kv: KVCacheManager, request_id: str) -> list[int]:
    ids = kv.get_block_ids(request_id)
    return [sum(1 for b in ids[g :: kv.num_groups] if b != 0) for g in range(kv.num_groups)]


def test_grouping_follows_the_layer_kinds():
    # Gemma 3 270M's pattern: five local layers, then a global one, three times.
    windows = ([512] * 5 + [None]) * 3
    groups = kv_cache_groups(windows)
    assert groups.groups[0] == KVCacheGroup((5, 11, 17), None)
    assert [g.layers for g in groups.groups[1:]] == [
        (0, 1, 2),
        (3, 4, 6),
        (7, 8, 9),
        (10, 12, 13),
        (14, 15, 16),
    ]
    assert groups.layers_per_group == 3 and groups.num_tensor_pairs() == 3
    assert groups.layer_slots()[6] == (2, 2)
    # A 4,096-token request: 256 blocks for the global group, 33 + 1 for each local one.
    assert groups.max_blocks_per_request(4096, 16) == 256 + 5 * 33
    # One pipeline stage of layers 0-8 needs pairs for three local layers of group 2.
    assert groups.num_tensor_pairs(range(0, 9)) == 3
    assert kv_cache_groups([None, None]) == KVCacheGroups((KVCacheGroup((0, 1)),))


def test_a_windowed_group_holds_its_window_while_decoding_far_past_it():
    kv = KVCacheManager(num_blocks=40, block_size=BLOCK_SIZE, group_windows=(None, WINDOW))
    request = make_request("a", 9)
    bound = cdiv(WINDOW, BLOCK_SIZE) + 1
    decode(kv, request, 0)
    for _ in range(30):
        request.output_token_ids.append(7)
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        full, windowed = held_per_group(kv, "a")
        assert full == cdiv(request.num_computed_tokens, BLOCK_SIZE)
        assert windowed <= bound
        kv.check_integrity()
    # 39 tokens computed: the next query (position 39) sees 30..39, blocks 7..9.
    assert held_per_group(kv, "a") == [10, 3]
    assert kv.get_block_ids("a")[1::2][:7] == [0] * 7
    kv.free(request)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


def test_exact_block_ids_as_the_window_moves():
    kv = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE, group_windows=(WINDOW,))
    request = make_request("a", 12)
    assert [b.block_id for b in kv.allocate_slots(request, 12).new_blocks] == [1, 2, 3]
    request.num_computed_tokens = 12
    request.output_token_ids.append(5)
    # The query at 12 sees 3..12: block 0 (tokens 0-3) is still needed.
    assert [b.block_id for b in kv.allocate_slots(request, 1).new_blocks] == [4]
    assert kv.get_block_ids("a") == [1, 2, 3, 4]
    request.num_computed_tokens = 13
    request.output_token_ids.append(5)
    # The query at 13 sees 4..13: block 0 is freed, to the back of the free queue.
    assert kv.allocate_slots(request, 1).new_blocks == []
    assert kv.get_block_ids("a") == [0, 2, 3, 4]
    assert kv.block_pool.free_block_queue.block_ids()[-1] == 1
    assert kv.num_held_blocks("a") == 3
    kv.free(request)
    kv.check_integrity()
    assert kv.num_free_blocks == 11


def test_freed_blocks_make_room_for_others():
    # Six usable blocks: a long windowed request alone would need eight without freeing.
    kv = KVCacheManager(num_blocks=7, block_size=BLOCK_SIZE, group_windows=(WINDOW,))
    request = make_request("a", 4)
    decode(kv, request, 28)
    assert kv.num_held_blocks("a") <= cdiv(WINDOW, BLOCK_SIZE) + 1
    other = make_request("b", 8, offset=500)
    assert kv.allocate_slots(other, 8) is not None
    kv.free(request)
    kv.free(other)
    kv.check_integrity()
    assert kv.num_free_blocks == 6


def test_prefix_hits_are_per_group_and_skip_what_the_window_dropped():
    kv = KVCacheManager(num_blocks=30, block_size=BLOCK_SIZE, group_windows=(None, WINDOW))
    first = make_request("a", 21)
    assert kv.allocate_slots(first, 21) is not None
    first.num_computed_tokens = 21
    kv.free(first)
    second = make_request("b", 21)
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    # Five full blocks of 20 tokens, each cached by both groups (group 1's are its own).
    assert num_hit_tokens == 20 and len(hits) == 10
    assert {b.block_id for b in hits[0::2]}.isdisjoint(b.block_id for b in hits[1::2])
    allocation = kv.allocate_slots(second, 1, hits)
    assert allocation is not None
    # Computing token 20 needs keys 11..20: group 1 takes hits for blocks 2-4 only.
    ids = kv.get_block_ids("b")
    assert ids[1::2][:2] == [0, 0] and all(ids[1::2][2:])
    assert ids[0::2][:5] == [b.block_id for b in hits[0::2]]
    kv.check_integrity()
    kv.free(second)
    kv.check_integrity()
    assert kv.num_free_blocks == 29


def test_forked_samples_copy_on_write_in_every_group():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, group_windows=(None, WINDOW))
    parent = make_request("p", 6)
    assert kv.allocate_slots(parent, 6) is not None
    parent.num_computed_tokens = 6
    child = make_request("c", 6)
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    child.output_token_ids.append(9)
    allocation = kv.allocate_slots(child, 1)
    # Block 1 of each group is partly filled and shared: both are copied.
    assert len(allocation.block_copies) == 2
    assert kv.get_block_ids("c")[:2] == kv.get_block_ids("p")[:2]
    assert kv.get_block_ids("c")[2:] != kv.get_block_ids("p")[2:]
    kv.free(parent)
    kv.free(child)
    kv.check_integrity()
    assert kv.num_free_blocks == 19


@pytest.mark.parametrize("windows", [(None,), (WINDOW,), (None, WINDOW, WINDOW)])
def test_preemption_returns_every_block(windows):
    kv = KVCacheManager(num_blocks=40, block_size=BLOCK_SIZE, group_windows=windows)
    request = make_request("a", 5)
    decode(kv, request, 20)
    kv.free(request)  # what preemption does
    request.num_computed_tokens = 0
    decode(kv, request, 3)
    kv.free(request)
    kv.check_integrity()
    assert kv.num_free_blocks == 39
