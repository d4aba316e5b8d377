"""Offline data parallelism: `LLM(data_parallel_size=2)` runs two cores in this process and
gives DP=1's greedy output; prefix-aware routing keeps a shared prefix on one core."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.client.dp_router import ROUTING_ENV

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def prompts() -> list[dict]:
    mixed = [[(5 * n + 3 * i) % 500 + 3 for i in range(5 + 9 * n)] for n in range(8)]
    prefix = [(11 * i) % 500 + 3 for i in range(64)]
    shared = [[*prefix, n + 3, 2 * n + 5] for n in range(4)]
    return [{"prompt_token_ids": p} for p in mixed + shared]


@pytest.fixture(scope="module")
def dp1(tiny_llama) -> tuple[list[str], int]:
    """DP=1's greedy texts and prefix-cache hits (in tokens) on prompts()."""
    llm = LLM(str(tiny_llama))
    outputs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    return [o.outputs[0].text for o in outputs], llm.get_stats().prefix_cache_hits


def test_dp2_generate_equals_dp1(tiny_llama, dp1, monkeypatch):
    dp1_texts, dp1_hits = dp1
    monkeypatch.delenv(ROUTING_ENV, raising=False)
    llm = LLM(str(tiny_llama), data_parallel_size=2)
    outputs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == dp1_texts
    engine = llm.llm_engine
    cores = engine.engine_cores
    assert len(cores) == 2 and engine.engine_core is cores[0]
    assert all(core.get_stats().num_computed_prompt_tokens for core in cores)  # both ran
    for core in cores:
        core.check_integrity()
    assert engine.engine_core_client.router.loads == [0, 0]
    stats = llm.get_stats()
    assert stats.prefix_cache_queries == sum(c.get_stats().prefix_cache_queries for c in cores)
    # The 4 prompts sharing a 4-block prefix went to one core: no hit lost to the split.
    assert dp1_hits > 0 and stats.prefix_cache_hits == dp1_hits
    assert llm.reset_prefix_cache()
    # A second round, streamed and aborted half-way, leaves both cores clean.
    stream = engine.stream(prompts()[0], SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not engine.has_unfinished_requests()
    assert engine.engine_core_client.router.loads == [0, 0]
    for core in cores:
        core.check_integrity()


def test_dp2_parallel_samples_stay_on_one_core(tiny_llama):
    llm = LLM(str(tiny_llama), data_parallel_size=2)
    params = SamplingParams(n=3, max_tokens=4, seed=7, ignore_eos=True)
    seeded = llm.generate(prompts()[:2], params, use_tqdm=False)
    single = LLM(str(tiny_llama)).generate(prompts()[:2], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in seeded] == [
        [c.token_ids for c in o.outputs] for o in single
    ]
    assert llm.llm_engine.engine_core_client.router.loads == [0, 0]
