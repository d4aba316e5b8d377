"""`DPRouter`: exact choices on crafted block hashes and loads (pure Python, no engine)."""

from __future__ import annotations

import pytest

from pagedllm.client.dp_router import (
    DEFAULT_LOAD_THRESHOLD,
    ROUTING_ENV,
    DPRouter,
    prompt_block_hashes,
    routing_policy_from_env,
)
from pagedllm.core import hashing
from pagedllm.core.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.sampling_params import SamplingParams


def load(router: DPRouter, engine: int, count: int, tag: str = "load") -> None:
    """Put `count` running requests without blocks on a core."""
    for index in range(count):
        router.assign(engine, f"{tag}-{engine}-{index}", 1, [])


def test_no_prefix_anywhere_spreads_in_turn():
    router = DPRouter(3, 100)
    assert [router.route(f"r{i}", 1, []) for i in range(3)] == [0, 1, 2]
    assert router.loads == [1, 1, 1]
    # Equal loads again after these finish: the turn goes on where it was.
    for i in range(3):
        router.finish(f"r{i}")
    assert router.route("r3", 1, [7]) == 0


def test_least_loaded_without_a_prefix():
    router = DPRouter(3, 100)
    load(router, 0, 2)
    load(router, 1, 1)
    load(router, 2, 3)
    assert router.route("new", 1, [99]) == 1


def test_longest_held_prefix_wins():
    router = DPRouter(2, 100)
    assert router.route("a", 1, [1, 2, 3]) == 0
    assert router.route("b", 1, [10, 11]) == 1
    assert router.route("a2", 1, [1, 2, 3, 4]) == 0  # holds 3 blocks of it
    assert router.route("b2", 1, [10, 11, 12]) == 1
    # Both hold the first block of [1, 2, 3]; core 1 holds two.
    router = DPRouter(2, 100)
    router.assign(0, "x", 1, [1])
    router.assign(1, "y", 1, [1, 2])
    assert router.route("z", 1, [1, 2, 3]) == 1


def test_a_chain_break_ends_the_match():
    router = DPRouter(2, 100)
    router.assign(0, "a", 1, [1, 2, 3])
    # Block 5 is not held, so block 3 after it cannot be the same prefix.
    assert router.matched_blocks(0, [1, 5, 3]) == 1
    assert router.matched_blocks(0, [5, 2, 3]) == 0


def test_a_clearly_busier_prefix_holder_is_passed_over():
    router = DPRouter(2, 100, load_threshold=4)
    router.assign(0, "a", 1, [1, 2])
    load(router, 0, 4)  # core 0: 5 requests, core 1: 0 -> 5 more than the least loaded
    assert router.loads == [5, 0]
    assert router.choose([1, 2, 3]) == 1
    router.finish("load-0-0")  # 4 more: not clearly busier any more
    assert router.choose([1, 2, 3]) == 0


def test_a_busy_best_holder_yields_to_a_shorter_holder_not_busy():
    router = DPRouter(3, 100, load_threshold=2)
    router.assign(0, "a", 1, [1, 2, 3])
    router.assign(1, "b", 1, [1])
    load(router, 0, 3)  # core 0: 4, core 1: 1, core 2: 0
    assert router.choose([1, 2, 3, 4]) == 1  # holds one block and is within the threshold


def test_equal_matches_go_to_the_lighter_core():
    router = DPRouter(2, 100)
    router.assign(0, "a", 1, [1, 2])
    router.assign(1, "b", 1, [1, 2])
    load(router, 0, 1)
    assert router.route("c", 1, [1, 2, 5]) == 1


def test_samples_follow_their_request_and_count_as_load():
    router = DPRouter(2, 100)
    engine = router.route("req", 3, [1])
    assert [router.engine_of(i) for i in ("req", "req#1", "req#2")] == [engine] * 3
    assert router.loads[engine] == 3
    assert router.finish("req#1") == engine
    assert router.finish("req#1") is None  # finished already: nothing changes
    assert router.loads[engine] == 2
    assert router.engine_of("req#1") is None


def test_held_blocks_are_a_bounded_lru():
    router = DPRouter(2, 4)
    router.assign(0, "a", 1, [1, 2, 3])
    router.assign(0, "b", 1, [4, 5])  # 5 blocks for 4 places: block 1, the oldest, goes
    assert router.matched_blocks(0, [1, 2, 3]) == 0
    assert router.matched_blocks(0, [4, 5]) == 2
    router.assign(0, "c", 1, [2])  # used again: now the newest
    router.assign(0, "d", 1, [6])  # evicts 3, the oldest
    assert list(router._blocks[0]) == [4, 5, 2, 6]


def test_round_robin_ignores_prefixes_and_load():
    router = DPRouter(2, 100, policy="round_robin")
    router.assign(0, "a", 1, [1, 2, 3])  # the turn moves to core 1
    load(router, 1, 5)  # the turn is core 0's again
    assert [router.route(f"r{i}", 1, [1, 2, 3]) for i in range(4)] == [0, 1, 0, 1]


def test_restarting_cores_are_left_out():
    router = DPRouter(3, 100)
    router.assign(1, "a", 1, [1, 2])
    assert router.choose([1, 2], exclude=[1]) == 2  # the turn, as nobody holds it
    assert router.choose([], exclude=[0, 1]) == 2
    with pytest.raises(ValueError, match="no engine core"):
        router.choose([], exclude=[0, 1, 2])


def test_forgetting_a_replaced_core():
    router = DPRouter(2, 100)
    router.assign(0, "a", 2, [1, 2])
    router.assign(1, "b", 1, [3])
    assert sorted(router.forget_engine(0)) == ["a", "a#1"]
    assert router.loads == [0, 1]
    assert router.matched_blocks(0, [1, 2]) == 0
    assert router.engine_of("b") == 1
    router.forget_blocks(1)  # a prefix-cache reset: requests stay, prefixes go
    assert router.engine_of("b") == 1 and router.matched_blocks(1, [3]) == 0


def test_block_hashes_are_the_prefix_caches():
    tokens = list(range(37))
    expected: list[int] = []
    hashing.extend_block_hashes(expected, tokens, 16, None)
    assert prompt_block_hashes(tokens, 16, None) == expected
    assert len(expected) == 2  # full blocks only
    salted = prompt_block_hashes(tokens, 16, "tenant-a")
    assert salted[0] != expected[0] and salted[1] != expected[1]  # the salt runs down the chain
    # A tenant's salted prompt does not match another tenant's cached prefix.
    router = DPRouter(2, 100)
    router.assign(1, "a", 1, salted)
    assert router.matched_blocks(1, prompt_block_hashes(tokens, 16, "tenant-b")) == 0
    assert router.matched_blocks(1, prompt_block_hashes(tokens + [1] * 20, 16, "tenant-a")) == 2


def test_policy_from_the_environment(monkeypatch):
    monkeypatch.delenv(ROUTING_ENV, raising=False)
    assert routing_policy_from_env() == "prefix"
    monkeypatch.setenv(ROUTING_ENV, "round_robin")
    assert routing_policy_from_env() == "round_robin"
    monkeypatch.setenv(ROUTING_ENV, "random")
    with pytest.raises(ValueError, match=ROUTING_ENV):
        routing_policy_from_env()


def test_bad_arguments():
    with pytest.raises(ValueError):
        DPRouter(0, 10)
    with pytest.raises(ValueError):
        DPRouter(2, 10, policy="random")
    assert DPRouter(2, 10).load_threshold == DEFAULT_LOAD_THRESHOLD


def test_routing_an_engine_request_and_finishing_it():
    router = DPRouter(2, 100)
    request = EngineCoreRequest("p", list(range(8)), SamplingParams(n=2), [], 0.0, cache_salt="s")
    engine = router.route_request(request, block_size=4, exclude=[0])
    assert engine == 1 and router.loads == [0, 2]
    assert router.matched_blocks(1, prompt_block_hashes(list(range(8)), 4, "s")) == 2
    # Finished outputs release their samples; the rest are aborted, grouped by core.
    router.finish_outputs([EngineCoreOutput("p", [1], True), EngineCoreOutput("x", [], True)])
    assert router.loads == [0, 1]
    assert router.finish_all(["p", "p#1", "unknown"]) == {1: ["p#1"]}
    assert router.loads == [0, 0]
