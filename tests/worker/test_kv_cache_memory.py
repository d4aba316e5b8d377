"""The CPU KV cache: zeroed, mapped lazily (RAM only for blocks in use until the background
prefault reaches them), and usable."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

from pagedllm import LLM, SamplingParams


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s own pages in RAM (mincore). The process's RSS also counts
    whatever else the process faults in meanwhile: in a whole-suite run it once grew by
    0.5 GB across this engine's start, with the cache itself untouched (what other tests
    left running or cached is in the same process)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.nbytes - start
    pages = (length + page - 1) // page
    in_ram = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), in_ram) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return (pages - bytes(in_ram).count(0)) * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mincore")
def test_cache_is_zero_and_costs_ram_only_where_written(tiny_llama, monkeypatch):
    # Without the background prefault, which would fault the whole pool in while idle.
    monkeypatch.setenv("PAGEDLLM_KV_PREFAULT", "0")
    llm = LLM(str(tiny_llama), max_model_len=64, kv_cache_memory="2GiB")
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    caches = [cache for pair in runner.kv_caches for cache in pair]
    cache_bytes = sum(cache.nbytes for cache in caches)
    assert cache_bytes > 1.9 * 2**30
    assert sum(resident_bytes(cache) for cache in caches) < 2**30 / 4
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
