"""Scheduler with a fake runner and no model: budget, chunking, preemption and arrival order."""

import random

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.sampling_params import SamplingParams

EOS = 99


def make_scheduler(
    num_blocks=65,
    block_size=4,
    budget=32,
    max_num_seqs=8,
    max_model_len=128,
    policy="fcfs",
    caching=False,
):
    # Prompts here are all ones; caching off keeps them from sharing blocks.
    config = SchedulerConfig(budget, max_num_seqs, max_model_len, policy)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, caching))


def add(scheduler, request_id, num_prompt_tokens, max_tokens=4, priority=0, **params):
    params = SamplingParams(max_tokens=max_tokens, **params)
    request = Request(
        request_id, [1] * num_prompt_tokens, params, frozenset({EOS}), priority=priority
    )
    scheduler.add_request(request)
    return request


def fake_run(scheduler: Scheduler, output: SchedulerOutput, token_id: int = 7) -> ModelRunnerOutput:
    """Sample `token_id` for every request whose computed tokens caught up this step."""
    sampled = {}
    for request_id in output.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens >= request.num_tokens:
            sampled[request_id] = [token_id]
    return ModelRunnerOutput(sampled_token_ids=sampled)


def step(scheduler, token_id=7):
    output = scheduler.schedule()
    scheduler.update_from_output(output, fake_run(scheduler, output, token_id))
    scheduler.kv_cache_manager.check_integrity()
    return output


def assert_all_blocks_free(scheduler):
    kv = scheduler.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


def test_budget_and_max_num_seqs_are_never_exceeded():
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=41, budget=24, max_num_seqs=5)
    requests = [add(scheduler, str(i), rng.randint(1, 60), rng.randint(1, 12)) for i in range(30)]
    steps = 0
    while scheduler.has_unfinished_requests():
        output = step(scheduler)
        assert 0 < output.total_num_scheduled_tokens <= 24
        assert len(output.num_scheduled_tokens) <= 5
        assert len(scheduler.running) <= 5
        steps += 1
        assert steps < 2000
    for request in requests:
        assert request.num_output_tokens == request.sampling_params.max_tokens
        assert request.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.num_preemptions > 0  # the pool is small enough to force some
    assert_all_blocks_free(scheduler)


def test_long_prompt_is_chunked_and_shares_steps_with_decodes():
    scheduler = make_scheduler(budget=16)
    add(scheduler, "short", 3, max_tokens=10)
    first = step(scheduler)
    assert first.num_scheduled_tokens == {"short": 3}
    add(scheduler, "long", 40)
    chunks = [step(scheduler).num_scheduled_tokens for _ in range(3)]
    assert chunks == [
        {"short": 1, "long": 15},
        {"short": 1, "long": 15},
        {"short": 1, "long": 10},
    ]
    assert scheduler.requests["long"].num_output_tokens == 1  # sampled when it caught up
    assert scheduler.requests["short"].num_output_tokens == 4


def test_running_requests_come_before_waiting_ones():
    scheduler = make_scheduler(budget=8)
    add(scheduler, "a", 8)
    assert step(scheduler).num_scheduled_tokens == {"a": 8}
    add(scheduler, "b", 20)
    assert list(step(scheduler).num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]


def test_waiting_requests_are_admitted_in_arrival_order_up_to_max_num_seqs():
    scheduler = make_scheduler(budget=100, max_num_seqs=3)
    for name in "abcde":
        add(scheduler, name, 2, max_tokens=2)
    assert list(step(scheduler).num_scheduled_tokens) == ["a", "b", "c"]
    assert list(step(scheduler).num_scheduled_tokens) == ["a", "b", "c"]
    assert list(step(scheduler).num_scheduled_tokens) == ["d", "e"]


def test_newest_running_request_is_preempted_and_resumed_first():
    # 6 usable blocks of 4 tokens; three requests of 8 tokens fill them.
    scheduler = make_scheduler(num_blocks=7, block_size=4, budget=64)
    _a, _b, c = (add(scheduler, name, 8, max_tokens=20) for name in "abc")
    step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    output = step(scheduler)  # each needs a third block: c (newest) is preempted
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert list(output.num_scheduled_tokens) == ["a", "b"]
    assert scheduler.waiting.peek() is c
    assert scheduler.kv_cache_manager.get_block_ids("c") == []
    add(scheduler, "d", 1)
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    output = step(scheduler)
    assert list(output.num_scheduled_tokens) == ["b", "c"]  # c resumes before d arrives
    (resumed,) = output.scheduled_cached_reqs[1:]
    assert resumed.request_id == "c" and resumed.resumed_from_preemption
    assert resumed.new_block_ids == scheduler.kv_cache_manager.get_block_ids("c")
    assert output.num_scheduled_tokens["c"] == c.num_prompt_tokens + 1  # prompt + its one output
    assert "a" in output.finished_req_ids


def test_no_new_admissions_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=5, block_size=4, budget=64)
    add(scheduler, "a", 8, max_tokens=20)
    add(scheduler, "b", 8, max_tokens=20)
    step(scheduler)
    add(scheduler, "c", 1)
    output = step(scheduler)
    assert scheduler.num_preemptions == 1
    assert "c" not in output.num_scheduled_tokens


def test_token_level_stops():
    scheduler = make_scheduler()
    eos = add(scheduler, "eos", 2, max_tokens=10)
    ignored = add(scheduler, "ignore", 2, max_tokens=3, ignore_eos=True)
    stop = add(scheduler, "stop", 2, max_tokens=10, stop_token_ids=[EOS + 1], ignore_eos=True)
    step(scheduler, token_id=EOS)
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop.status == RequestStatus.RUNNING and ignored.status == RequestStatus.RUNNING
    step(scheduler, token_id=EOS + 1)
    assert stop.status == RequestStatus.FINISHED_STOPPED and stop.stop_reason == EOS + 1
    step(scheduler, token_id=EOS)
    assert ignored.status == RequestStatus.FINISHED_LENGTH
    assert ignored.output_token_ids == [EOS, EOS + 1, EOS]
    assert_all_blocks_free(scheduler)


def test_max_model_len_ends_a_request():
    scheduler = make_scheduler(max_model_len=10)
    request = add(scheduler, "a", 8, max_tokens=None)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert request.num_tokens == 10 and request.status == RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("state", ["waiting", "running", "preempted"])
def test_abort_frees_blocks_from_any_state(state):
    scheduler = make_scheduler(num_blocks=5, block_size=4, budget=64)
    a = add(scheduler, "a", 8, max_tokens=20)
    b = add(scheduler, "b", 8, max_tokens=20)
    if state != "waiting":
        step(scheduler)
    if state == "preempted":
        step(scheduler)
        assert b.status == RequestStatus.PREEMPTED
    scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)


def test_duplicate_request_id_is_refused():
    scheduler = make_scheduler()
    add(scheduler, "a", 2)
    with pytest.raises(ValueError, match="already in use"):
        add(scheduler, "a", 2)


def test_priority_policy_preempts_the_lowest_priority_not_the_newest():
    scheduler = make_scheduler(num_blocks=7, block_size=4, budget=64, policy="priority")
    low = add(scheduler, "low", 7, max_tokens=20, priority=5)
    step(scheduler)
    high = add(scheduler, "high", 8, max_tokens=20, priority=0)
    mid = add(scheduler, "mid", 8, max_tokens=20, priority=1)
    step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    step(scheduler)
    assert low.status == RequestStatus.PREEMPTED  # admitted first, but lowest priority
    assert high.status == RequestStatus.RUNNING
    assert scheduler.num_preemptions >= 1
    assert mid.num_preemptions + low.num_preemptions == scheduler.num_preemptions


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler = make_scheduler(budget=100, max_num_seqs=1, policy="priority")
    for name, priority in [("x", 0), ("y", 3), ("z", -2), ("w", 0)]:
        add(scheduler, name, 2, max_tokens=1, priority=priority)
    order = [next(iter(step(scheduler).num_scheduled_tokens)) for _ in range(4)]
    assert order == ["z", "x", "w", "y"]
