"""What the scheduler tells ranks that do not sample, and the pipeline batch queue's rule,
with no model: a rank that learns tokens only from `CachedRequestData.token_ids` lays out
exactly the tokens, and picks exactly the rows that sample, of the sampling rank, through
chunked prefill and preemption; with two batches in flight no request is in both, and none
in flight is preempted."""

from __future__ import annotations

import random

import numpy as np

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.runner.input_batch import InputBatch
from pagedllm.sampling_params import SamplingParams

MAX_LEN = 96


def _scheduler(num_blocks: int, in_flight: int = 1) -> Scheduler:
    config = SchedulerConfig(16, 8, MAX_LEN, send_token_ids=True, max_batches_in_flight=in_flight)
    return Scheduler(config, KVCacheManager(num_blocks, 4, False))


def _add_requests(scheduler: Scheduler, rng: random.Random, count: int) -> None:
    for index in range(count):
        prompt = [rng.randrange(1, 90) for _ in range(rng.randrange(1, 30))]
        params = SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True)
        scheduler.add_request(Request(f"r{index}", prompt, params, frozenset()))


def _run(scheduler: Scheduler, output: SchedulerOutput, rng: random.Random) -> ModelRunnerOutput:
    """The sampling rank: a random token for every request that caught up."""
    sampled = {}
    for request_id in output.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens >= request.num_tokens:
            sampled[request_id] = [rng.randrange(1, 90)]
    return ModelRunnerOutput(sampled_token_ids=sampled)


def test_a_rank_that_does_not_sample_sees_what_the_sampling_rank_sees():
    rng = random.Random(0)
    scheduler = _scheduler(num_blocks=20)  # small: preemption happens
    _add_requests(scheduler, rng, 12)
    mirror = InputBatch(MAX_LEN, MAX_LEN // 4)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        for request_id in output.finished_req_ids:
            mirror.remove_request(request_id)
        for new in output.scheduled_new_reqs:
            row = mirror.add_request(new.request_id, new.prompt_token_ids, new.sampling_params, 90)
            mirror.num_computed_tokens[row] = new.num_computed_tokens
        for cached in output.scheduled_cached_reqs:
            row = mirror.row(cached.request_id)
            mirror.num_computed_tokens[row] = cached.num_computed_tokens
            mirror.write_tokens(
                row, cached.num_computed_tokens, cached.token_ids, cached.resumed_from_preemption
            )
        for request_id, count in output.num_scheduled_tokens.items():
            request, row = scheduler.requests[request_id], mirror.row(request_id)
            start = request.num_computed_tokens - count  # already advanced by schedule()
            expected = request.all_token_ids[start : start + count]
            assert mirror.token_ids[row, start : start + count].tolist() == expected
            samples = start + count >= mirror.num_tokens[row]
            assert samples == (request.num_computed_tokens >= request.num_tokens), request_id
        scheduler.update_from_output(output, _run(scheduler, output, rng))
    assert scheduler.num_preemptions > 0


def test_two_batches_in_flight_never_share_a_request_or_preempt_one():
    rng = random.Random(1)
    scheduler = _scheduler(num_blocks=24, in_flight=2)
    _add_requests(scheduler, rng, 12)
    queue: list[SchedulerOutput] = []
    steps = 0
    while scheduler.has_unfinished_requests():
        steps += 1
        assert steps < 2000
        if len(queue) < 2:
            output = scheduler.schedule()
            in_flight = {r for batch in queue for r in batch.num_scheduled_tokens}
            assert in_flight.isdisjoint(output.num_scheduled_tokens)
            for request_id in in_flight:  # still running, with its blocks
                assert scheduler.requests[request_id].status.name == "RUNNING"
            if output.num_scheduled_tokens:
                queue.append(output)
                continue
        oldest = queue.pop(0)
        scheduler.update_from_output(oldest, _run(scheduler, oldest, rng))
        scheduler.kv_cache_manager.check_integrity()
    assert not queue and scheduler.num_preemptions > 0
    assert np.isclose(scheduler.kv_cache_manager.block_pool.usage, 0)
