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
    whatever else the process faults in meanwhile."""
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


# A process that has used and freed much of its heap (as a test suite has by this test's
# turn): calloc may hand back a dirty free chunk of the heap and clear it, every page then
# resident (a whole-suite run once started this test's 2 GiB pool with 512 MB in RAM). The
# fixed mmap threshold keeps glibc from mapping the 16 MB chunks on their own.
_DIRTY_HEAP_THEN_POOL = """
import ctypes
import sys
import torch
from pagedllm.runner.huge_pages import mapped_zeros
sys.path.insert(0, sys.argv[1])
from test_kv_cache_memory import resident_bytes
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
chunks = [libc.malloc(16 << 20) for _ in range(40)]
for chunk in chunks:
    ctypes.memset(chunk, 1, 16 << 20)
pin = libc.malloc(1 << 20)  # above them: the heap cannot shrink back
for chunk in chunks:
    libc.free(chunk)
pool = torch.from_numpy(mapped_zeros(512 << 20))
print(resident_bytes(pool), int(pool.any()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, mincore")
def test_pool_memory_is_its_own_mapping_not_a_dirty_heap_chunk():
    import subprocess

    here = os.path.dirname(__file__)
    result = subprocess.run(
        [sys.executable, "-c", _DIRTY_HEAP_THEN_POOL, here],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    resident, nonzero = map(int, result.stdout.split())
    assert nonzero == 0
    assert resident < 16 << 20  # np.zeros (calloc) here: all 512 MB
