"""The CPU KV cache: zeroed, mapped lazily (RAM only for blocks in use until the background
prefault reaches them), and usable."""

from __future__ import annotations

import sys

import pytest
import torch

from pagedllm import LLM, SamplingParams


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_cache_is_zero_and_costs_ram_only_where_written(tiny_llama, monkeypatch):
    # Without the background prefault, which would fault the whole pool in while idle.
    monkeypatch.setenv("PAGEDLLM_KV_PREFAULT", "0")
    before = resident_bytes()
    llm = LLM(str(tiny_llama), max_model_len=64, kv_cache_memory="2GiB")
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    cache_bytes = sum(2 * k.numel() * k.element_size() for k, _ in runner.kv_caches)
    assert cache_bytes > 1.9 * 2**30
    assert resident_bytes() - before < 2**30 / 4
    key_cache = runner.kv_caches[0][0]
    assert not key_cache[:4].any() and not key_cache[-4:].any()
    out = llm.generate(
        {"prompt_token_ids": [3, 4, 5, 6]},
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    assert len(out[0].outputs[0].token_ids) == 4
    written = key_cache.flatten(1).any(dim=1).nonzero().flatten()
    assert len(written) > 0, "the step's keys were not written into the cache"
    assert torch.isfinite(key_cache[written]).all()
