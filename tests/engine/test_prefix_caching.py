"""Prefix caching, priorities and abort through the engine on tiny models."""

import random

import pytest
import torch
from model_utils import compare_greedy, hf_greedy
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.core import hashing
from pagedllm.core.request import RequestStatus

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def shared_prefix_prompts(seed=0, num_prefixes=3, per_prefix=4):
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(3, 512) for _ in range(rng.randint(20, 60))] for _ in range(num_prefixes)
    ]
    prompts = [
        {"prompt_token_ids": prefix + [rng.randrange(3, 512) for _ in range(rng.randint(1, 12))]}
        for prefix in prefixes
        for _ in range(per_prefix)
    ]
    rng.shuffle(prompts)
    return prompts


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_caching_on_and_off_give_identical_greedy_output(tiny_llama):
    prompts = shared_prefix_prompts()
    # 25 usable blocks of 8 tokens (512 bytes a token): too few for all prompts at once.
    small = dict(
        max_model_len=128, block_size=8, max_num_batched_tokens=64, kv_cache_memory=512 * 8 * 26
    )
    cached = LLM(str(tiny_llama), **small)
    uncached = LLM(str(tiny_llama), enable_prefix_caching=False, **small)
    with_cache = token_ids(cached.generate(prompts, GREEDY, use_tqdm=False))
    # Run again: now every shared prefix is warm.
    warm = token_ids(cached.generate(prompts[::-1], GREEDY, use_tqdm=False))[::-1]
    without = token_ids(uncached.generate(prompts, GREEDY, use_tqdm=False))
    assert with_cache == without == warm
    stats = cached.get_stats()
    assert stats.num_preemptions > 0, "the small KV budget should force preemption"
    assert stats.prefix_cache_hits > 0
    assert uncached.get_stats().prefix_cache_hits == 0


def test_constant_hash_still_matches_transformers(tiny_llama, monkeypatch, report_ties):
    monkeypatch.setattr(hashing, "hash_block_tokens", lambda *args: 0)
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    prompts = shared_prefix_prompts(seed=1, per_prefix=3)
    llm = LLM(str(tiny_llama), max_model_len=128, block_size=4)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    outputs += llm.generate(prompts, GREEDY, use_tqdm=False)  # warm cache, all hashes equal
    ties = 0
    for prompt, output in zip(prompts * 2, outputs, strict=True):
        reference = hf_greedy(hf_model, prompt["prompt_token_ids"], GREEDY.max_tokens)
        ties += compare_greedy(output.outputs[0].token_ids, reference, 1e-4)
    report_ties(ties, len(outputs))
    assert llm.get_stats().prefix_cache_hits > 0


def test_shared_system_prompt_is_computed_once(tiny_llama):
    rng = random.Random(2)
    system = [rng.randrange(3, 512) for _ in range(500)]
    prompts = [
        system + [rng.randrange(3, 512) for _ in range(rng.randint(5, 20))] for _ in range(20)
    ]
    llm = LLM(str(tiny_llama), max_model_len=1024, block_size=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    cached_len = 500 // 16 * 16  # the partial block of the system prompt is recomputed
    expected = len(prompts[0]) + sum(len(p) - cached_len for p in prompts[1:])
    stats = llm.get_stats()
    assert stats.num_computed_prompt_tokens == expected
    assert [o.num_cached_tokens for o in outputs] == [0] + [cached_len] * 19
    uncached = LLM(str(tiny_llama), max_model_len=1024, block_size=16, enable_prefix_caching=False)
    reference = uncached.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
    )
    assert token_ids(outputs) == token_ids(reference)
    assert uncached.get_stats().num_computed_prompt_tokens == sum(len(p) for p in prompts)


def test_stats_report_usage_and_hits(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, block_size=8)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    llm.generate([prompt, prompt], GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == stats.num_used_blocks == 0
    assert stats.kv_cache_usage == 0.0
    assert stats.prefix_cache_queries == 2 * 37
    assert stats.prefix_cache_hits == 32  # the second copy reuses 4 full blocks
    assert stats.num_cached_blocks >= 4
    assert 0 < stats.prefix_cache_hit_rate < 1


def test_high_priority_request_submitted_last_finishes_first(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.llm_engine
    for index in range(4):
        prompt = {"prompt_token_ids": [5 + index] * 10}
        engine.add_request(f"r{index}", prompt, GREEDY, priority=-1 if index == 3 else 0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["r3", "r0", "r1", "r2"]


def test_priority_needs_the_priority_policy(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64)
    with pytest.raises(ValueError, match="priority"):
        llm.generate([{"prompt_token_ids": [1, 2]}], GREEDY, priority=[1], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(str(tiny_llama), scheduling_policy="lifo")


def test_cache_salt_separates_tenants(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, block_size=8)
    tokens = list(range(3, 40))
    llm.generate({"prompt_token_ids": tokens, "cache_salt": "a"}, GREEDY, use_tqdm=False)
    other = llm.generate({"prompt_token_ids": tokens, "cache_salt": "b"}, GREEDY, use_tqdm=False)
    same = llm.generate({"prompt_token_ids": tokens, "cache_salt": "a"}, GREEDY, use_tqdm=False)
    assert other[0].num_cached_tokens == 0 and same[0].num_cached_tokens == 32
    assert token_ids(other) == token_ids(same)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": tokens, "cache_salt": ""}, use_tqdm=False)


@pytest.mark.parametrize("state", ["waiting", "running", "preempted"])
def test_abort_frees_every_block(tiny_llama, state):
    llm = LLM(str(tiny_llama), max_model_len=64, block_size=4, kv_cache_memory=512 * 4 * 25)
    engine, core = llm.llm_engine, llm.llm_engine.engine_core
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for index in range(3):
        engine.add_request(f"r{index}", {"prompt_token_ids": [7 + index] * 30}, params)
    target = {
        "waiting": RequestStatus.WAITING,
        "running": RequestStatus.RUNNING,
        "preempted": RequestStatus.PREEMPTED,
    }[state]
    request = None
    for _ in range(100):
        request = next((r for r in core.scheduler.requests.values() if r.status == target), None)
        if request is not None:
            break
        engine.step()
    assert request is not None, f"no request reached {state}"
    engine.abort_request([request.request_id])
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert core.kv_cache_manager.get_block_ids(request.request_id) == []
    core.check_integrity()
    while engine.has_unfinished_requests():
        assert all(o.request_id != request.request_id for o in engine.step())
    core.check_integrity()
    runner_rows = core.model_executor.driver_worker.model_runner.input_batch.req_id_to_row
    engine.step()  # the runner drops finished requests' rows on the next step
    assert request.request_id not in runner_rows


def test_reset_prefix_cache_refuses_while_requests_run(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64, block_size=4)
    prompt = {"prompt_token_ids": list(range(3, 20))}
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.get_stats().num_cached_blocks > 0
    llm.llm_engine.add_request("busy", prompt, GREEDY)
    assert llm.reset_prefix_cache() is False
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert llm.reset_prefix_cache() is True
    assert llm.get_stats().num_cached_blocks == 0
