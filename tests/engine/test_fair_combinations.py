"""The fair policy with each feature it once refused, end to end on a tiny Llama: three
tenants share a pool small enough to preempt, and greedy tokens equal the engine's without
the feature and without tenants (ties counted, as everywhere) under speculative decoding
(drafts charged to their tenant), swap preemption and a host-memory KV tier; every block
comes back and no request stays swapped out. LoRA under fair: tests/lora/test_lora_engine.py."""

from __future__ import annotations

import pytest
from model_utils import MIXED_PROMPTS, compare_to_reference_engine, run_tenants

from pagedllm import LLM, SamplingParams

PROMPTS = MIXED_PROMPTS
MAX_TOKENS = 24
# Prompts prefilled in chunks and a pool of 13 blocks of 16 tokens for six requests of up to
# 64 tokens: preemption is certain.
TIGHT = {"max_num_batched_tokens": 16, "max_model_len": 96, "kv_cache_memory": 14 * 8192}
FEATURES = {
    "spec": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "swap": {"preemption_mode": "swap"},
    "offload": {"kv_offload_memory": "1MiB"},
}


def requests() -> list[tuple]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    tenants = ["a", "b", "c"]
    return [
        (f"r{i}", tenants[i % len(tenants)], prompt, params, None)
        for i, prompt in enumerate(PROMPTS)
    ]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=256, kv_cache_memory="8MiB")
    return run_tenants(llm, requests())


@pytest.mark.slow
@pytest.mark.parametrize("feature", FEATURES)
def test_fair_with_the_feature_equals_neither(tiny_llama, reference, report_ties, feature):
    llm = LLM(str(tiny_llama), scheduling_policy="fair", **TIGHT, **FEATURES[feature])
    actual = run_tenants(llm, requests())
    ties, _ = compare_to_reference_engine(reference, actual, tie_tolerance=1e-4)
    report_ties(ties, len(PROMPTS))
    core = llm.llm_engine.engine_core
    stats = core.get_stats()
    assert stats.num_preemptions > 0
    if feature == "spec":
        assert stats.spec_decode.num_drafts > 0
    if feature == "swap":
        assert stats.kv_tiers["swapped_in_requests"] == stats.num_preemptions
    core.check_integrity()
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks
    if core.kv_tiers is not None:  # host slots still used hold evicted prefixes, a cache
        assert not core.kv_tiers.swapped
