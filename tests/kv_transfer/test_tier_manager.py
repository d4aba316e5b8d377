"""`KVTierManager` on tiny pools and host tiers: each step's moves with exact block ids and
slots, the host tier's LRU, disk reads that park a request, swap, and transfer."""

from __future__ import annotations

import pytest

from pagedllm.core import hashing
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.kv_transfer.config import KVTierConfig, KVTransferConfig
from pagedllm.kv_transfer.core.tier_manager import KVTierManager, TierHit
from pagedllm.kv_transfer.ops import KVTransferResult, block_key
from pagedllm.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams())


def build(num_blocks=7, num_host_blocks=3, **config) -> tuple[KVCacheManager, KVTierManager]:
    tiers = KVTierManager(KVTierConfig("id", num_host_blocks, **config), BLOCK)
    kv = KVCacheManager(num_blocks, BLOCK, stable_hashes=True)
    kv.block_pool.on_evict = tiers.on_evict
    kv.on_publish = tiers.on_publish
    return kv, tiers


def run(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit a request whole (no tier lookup), compute it, free it; its block ids."""
    hits, num_hits = kv.get_computed_blocks(request)
    kv.allocate_slots(request, request.num_tokens - num_hits, hits)
    block_ids = kv.get_block_ids(request.request_id)
    kv.free(request)
    return block_ids


def keys_of(token_ids: list[int]) -> list[str]:
    hashes: list[int] = []
    hashing.extend_block_hashes(hashes, token_ids, BLOCK, None, stable=True)
    return [block_key(h, 0) for h in hashes]


def test_evicted_blocks_are_saved_and_found_again():
    kv, tiers = build()
    prefix = list(range(100, 109))  # two full blocks and one token
    assert run(kv, make_request("a", prefix)) == [1, 2, 3]
    assert tiers.take_ops() is None  # published, nothing evicted yet
    # Six fresh blocks: the free queue hands out 4, 5, 6, then a's 3, 2, 1 (tail first).
    assert run(kv, make_request("b", list(range(24)))) == [4, 5, 6, 3, 2, 1]
    ops = tiers.take_ops()
    # Block 3 held a partial block (never cached); a's two full blocks went to slots 0, 1.
    assert ops.saves == [(2, 0), (1, 1)]
    assert list(tiers.host) == [keys_of(prefix)[1], keys_of(prefix)[0]]

    again = make_request("c", [*prefix[:8], 7, 7])
    kv.update_block_hashes(again)
    _hits, num_hits = kv.get_computed_blocks(again)
    assert num_hits == 0  # b's blocks evicted a's from the pool
    hit = tiers.find(again, num_hits)
    assert isinstance(hit, TierHit) and hit.slots == [(0, 1), (1, 0)] and hit.num_tokens == 8
    allocation = kv.allocate_slots(again, hit.num_tokens + 2)
    tiers.load("c", hit, kv.get_block_ids("c"))
    assert tiers.take_ops().loads == [
        (1, allocation.new_block_ids[0]),
        (0, allocation.new_block_ids[1]),
    ]
    kv.free(again)
    tiers.check_integrity()


def test_host_tier_drops_its_least_recently_used_entry():
    kv, tiers = build(num_blocks=9, num_host_blocks=2)
    run(kv, make_request("a", list(range(100, 113))))  # three full blocks, 4 blocks in all
    run(kv, make_request("b", list(range(32))))  # eight fresh blocks evict a's three
    ops = tiers.take_ops()
    keys = keys_of(list(range(100, 113)))
    # Evicted tail first: block 3 to slot 0, block 2 to slot 1; block 1 finds no slot, as
    # a slot written in a step is never handed out again in that step.
    assert ops.saves == [(3, 0), (2, 1)]
    assert list(tiers.host) == [keys[2], keys[1]]
    tiers.check_integrity()


def test_slot_reuse_waits_for_the_next_step():
    kv, tiers = build(num_blocks=9, num_host_blocks=2)
    run(kv, make_request("a", list(range(100, 113))))
    run(kv, make_request("b", list(range(32))))
    tiers.take_ops()
    # Next step: a third key takes the least recently used slot (keys[2]'s, slot 0).
    run(kv, make_request("c", list(range(200, 209))))
    run(kv, make_request("d", list(range(300, 332))))
    ops = tiers.take_ops()
    assert ops.saves[0][1] == 0
    tiers.check_integrity()


PARKED = RequestStatus.WAITING_FOR_KV


def test_disk_blocks_park_the_request_until_read():
    keys = keys_of(list(range(100, 109)))
    tiers = KVTierManager(KVTierConfig("id", 3, disk_dir="/unused"), BLOCK, 1, keys)
    kv = KVCacheManager(7, BLOCK, stable_hashes=True)
    request = make_request("a", [*list(range(100, 109)), 5])
    kv.update_block_hashes(request)
    assert tiers.find(request, 0) is None and request.status is PARKED
    ops = tiers.take_ops()
    assert [(f.key, f.slot) for f in ops.fetches] == [(keys[0], 0), (keys[1], 1)]
    assert tiers.find(request, 0) is None and request.status is PARKED  # still reading
    tiers.apply_result(KVTransferResult(fetched=[(keys[0], 0, True), (keys[1], 1, False)]))
    assert "a" not in tiers.parked
    assert keys[1] not in tiers.disk_keys  # a failed read is forgotten: recomputed
    hit = tiers.find(request, 0)
    assert hit.slots == [(0, 0)] and hit.num_tokens == 4
    assert request.status is RequestStatus.WAITING
    tiers.check_integrity()


def test_swap_saves_and_restores_a_preempted_request():
    kv, tiers = build(num_host_blocks=4, preemption_mode="swap")
    request = make_request("a", list(range(10)))
    kv.allocate_slots(request, 10)
    request.num_computed_tokens = 10
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert tiers.swap_out(request, kv.req_to_blocks["a"], kv.block_pool.null_block)
    kv.free(request)
    assert tiers.take_ops().saves == [(1, 0), (2, 1), (3, 2)]
    request.num_computed_tokens = 0
    kv.allocate_slots(request, 11)
    assert kv.get_block_ids("a") == [4, 5, 6]  # the free queue's front
    tiers.load("a", tiers.swapped["a"], kv.get_block_ids("a"))
    assert tiers.take_ops().loads == [(0, 4), (1, 5), (2, 6)]
    assert tiers.num_free_host_blocks == 4
    kv.free(request)
    tiers.check_integrity()


def test_swap_refused_when_the_host_tier_is_too_small():
    kv, tiers = build(num_host_blocks=2, preemption_mode="swap")
    request = make_request("a", list(range(10)))
    kv.allocate_slots(request, 10)
    assert not tiers.swap_out(request, kv.req_to_blocks["a"], kv.block_pool.null_block)
    assert tiers.take_ops() is None
    kv.free(request)


def test_producer_ships_full_blocks_and_the_partial_tail():
    transfer = KVTransferConfig("kv_producer", kv_connector_extra_config={"peer": "h:1"})
    kv, tiers = build(num_host_blocks=0, transfer=transfer)
    request = make_request("a", list(range(10)))
    kv.allocate_slots(request, 10)
    tiers.on_prompt_computed(request, kv.update_block_hashes(request), [1, 2, 3], 0)
    (send,) = tiers.take_ops().sends
    keys = keys_of(list(range(10)))
    tail = hashing.partial_block_hash(int(keys[1].split(".")[0], 16), (8, 9), 2, None)
    assert [(r.block_id, r.key, r.token_ids) for r in send.blocks] == [
        (1, keys[0], (0, 1, 2, 3)),
        (2, keys[1], (4, 5, 6, 7)),
        (3, block_key(tail, 0), (8, 9)),
    ]
    kv.free(request)


def test_consumer_finds_the_shipped_tail():
    transfer = KVTransferConfig("kv_consumer")
    kv, tiers = build(num_host_blocks=4, transfer=transfer)
    prompt = list(range(10))
    keys = keys_of(prompt)
    tail = hashing.partial_block_hash(int(keys[1].split(".")[0], 16), (8, 9), 2, None)
    received = [(keys[0], (0, 1, 2, 3)), (keys[1], (4, 5, 6, 7)), (block_key(tail, 0), (8, 9))]
    tiers.on_received([*received, received[0]])
    ops = tiers.take_ops()
    assert ops.ingests == [(keys[0], 0), (keys[1], 1), (block_key(tail, 0), 2)]
    assert ops.drops == [keys[0]]  # already held
    request = make_request("a", prompt)
    kv.update_block_hashes(request)
    hit = tiers.find(request, 0)
    # 8 full-block tokens and the tail's first token: only the last prompt token runs.
    assert hit.slots == [(0, 0), (1, 1), (2, 2)] and hit.num_tokens == 9
    tiers.check_integrity()


@pytest.mark.parametrize("tokens", [[1, 2, 3, 4, 5]])
def test_prompt_logprobs_never_take_tier_hits(tokens):
    kv, tiers = build()
    run(kv, make_request("a", tokens * 3))
    request = Request("b", tokens * 3, SamplingParams(prompt_logprobs=1))
    kv.update_block_hashes(request)
    assert tiers.find(request, 0) is None


def test_a_parked_requests_blocks_stay_until_it_is_admitted():
    prompt = list(range(100, 113))  # three full blocks and one token
    keys = keys_of(prompt)
    tiers = KVTierManager(KVTierConfig("id", 3, disk_dir="/unused"), BLOCK, 1, keys[1:])
    kv = KVCacheManager(9, BLOCK, stable_hashes=True)
    kv.block_pool.on_evict = tiers.on_evict
    kv.on_publish = tiers.on_publish
    tiers.on_received([(keys[0], tuple(prompt[:4]))])  # the first block in host memory
    tiers.take_ops()
    request = make_request("a", prompt)
    kv.update_block_hashes(request)
    assert tiers.find(request, 0) is None and request.status is PARKED
    assert [(f.key, f.slot) for f in tiers.take_ops().fetches] == [(keys[1], 1), (keys[2], 2)]
    tiers.apply_result(KVTransferResult(fetched=[(keys[1], 1, True), (keys[2], 2, True)]))
    # Another request's evicted blocks find no slot: all three belong to the parked one.
    run(kv, make_request("b", list(range(12))))
    run(kv, make_request("c", list(range(200, 232))))
    assert tiers.take_ops().saves == []
    hit = tiers.find(request, 0)
    assert hit.slots == [(0, 0), (1, 1), (2, 2)] and hit.num_tokens == 12
    kv.allocate_slots(request, 13)
    tiers.load("a", hit, kv.get_block_ids("a"))
    tiers.take_ops()
    assert not tiers._pins  # admitted: its blocks are LRU entries again
    kv.free(request)
    tiers.check_integrity()
