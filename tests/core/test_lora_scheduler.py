"""LoRA in the scheduler, with a fake runner and tiny block pools: at most `max_loras`
adapters run in a step, a running or waiting request whose adapter has no slot waits while
the others go on, and the prefix cache keys blocks by adapter (exact block ids)."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

LORAS = [None, *(LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in (1, 2, 3))]


def make(num_blocks=17, block_size=4, budget=64, max_loras=2):
    config = SchedulerConfig(budget, 8, 64, max_loras=max_loras)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, True))


def add(scheduler, request_id, prompt, lora, max_tokens=3):
    request = Request(
        request_id, list(prompt), SamplingParams(max_tokens=max_tokens), lora_request=lora
    )
    scheduler.add_request(request)
    return request


def step(scheduler):
    """Schedule, then sample token 7 for every request due one; the step's adapters."""
    output = scheduler.schedule()
    scheduled = output.num_scheduled_tokens
    due = [
        r
        for r in scheduled
        if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
    ]
    scheduler.update_from_output(output, ModelRunnerOutput(sampled_token_ids={r: [7] for r in due}))
    scheduler.kv_cache_manager.check_integrity()
    return {scheduler.requests[r].lora_int_id for r in scheduled if r in scheduler.requests}, output


def test_at_most_max_loras_adapters_per_step_and_the_base_model_takes_no_slot():
    scheduler = make()
    for i, lora in enumerate([LORAS[1], LORAS[2], LORAS[3], None, LORAS[1]]):
        add(scheduler, f"r{i}", range(10 * i, 10 * i + 6), lora)
    adapters, output = step(scheduler)
    # a1 and a2 take the two slots; a3's request waits; the base and a second a1 request run.
    assert set(output.num_scheduled_tokens) == {"r0", "r1", "r3", "r4"}
    assert adapters == {1, 2, 0}
    seen = []
    while scheduler.has_unfinished_requests():
        adapters, _ = step(scheduler)
        assert len(adapters - {0}) <= 2
        seen.append(adapters)
    assert any(3 in adapters for adapters in seen)  # a3 ran once a slot was free
    assert scheduler.kv_cache_manager.num_free_blocks == 16


def test_a_running_request_without_a_slot_waits_while_others_run():
    scheduler = make(max_loras=1)
    add(scheduler, "x", range(6), LORAS[1], max_tokens=2)
    step(scheduler)
    add(scheduler, "y", range(20, 26), LORAS[2])
    add(scheduler, "z", range(30, 36), None)
    _, output = step(scheduler)
    assert set(output.num_scheduled_tokens) == {"x", "z"}  # y's adapter has no slot
    _, output = step(scheduler)  # x finished: y's adapter takes the slot
    assert "y" in output.num_scheduled_tokens


def test_prefix_cache_keys_blocks_by_adapter():
    scheduler = make(max_loras=3)
    kv = scheduler.kv_cache_manager
    prompt = range(40, 49)  # two full blocks and one token
    first = add(scheduler, "p1", prompt, LORAS[1], max_tokens=1)
    step(scheduler)
    assert first.is_finished
    other = add(scheduler, "p2", prompt, LORAS[2], max_tokens=1)
    same = add(scheduler, "p3", prompt, LORAS[1], max_tokens=1)
    base = add(scheduler, "p4", prompt, None, max_tokens=1)
    _, output = step(scheduler)
    assert output.num_scheduled_tokens == {"p2": 9, "p3": 1, "p4": 9}
    assert (other.num_cached_tokens, same.num_cached_tokens, base.num_cached_tokens) == (0, 8, 0)
    assert kv.num_free_blocks == 16
