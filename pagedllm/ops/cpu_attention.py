"""The "cpu" attention backend: a C++/OpenMP kernel that reads K/V in place from the paged cache.

This module owns building and loading the extension (pagedllm/ops/csrc/paged_attention.cpp,
compiled once with `torch.utils.cpp_extension.load` into a cache directory and reused by
later processes), and `CpuAttentionBackend`, which calls it for every step.
`build()` (or `python -m pagedllm.ops.cpu_attention`) compiles ahead of time, e.g. at
install, so that a first start does not wait for the compiler.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedllm.ops.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttentionBackend,
    write_kv_cache,
)

logger = logging.getLogger(__name__)

_EXTENSION_NAME = "pagedllm_paged_attention"
_SOURCES = [Path(__file__).parent / "csrc" / "paged_attention.cpp"]
# Explicit ISA flags rather than -march=native: the cache directory may be shared by
# machines of different generations, and AVX2 + FMA + F16C is all the kernel uses.
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_extension: Any = None  # torch.ops.pagedllm once loaded
_load_error: Exception | None = None
_fallback_logged = False


def cache_dir() -> Path:
    """Where the compiled extension lives, one directory per Python and torch version."""
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.expanduser("~/.cache/pagedllm")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return Path(root) / "extensions" / tag


def load() -> Any:
    """`torch.ops.pagedllm`, built on first use (about a minute) or loaded from the cache.

    Raises RuntimeError, naming the reason, when the CPU lacks AVX2 or the build fails;
    the failure is remembered so later calls in the process fail fast.
    """
    global _extension, _load_error
    if _extension is not None:
        return _extension
    if _load_error is not None:
        raise RuntimeError(f"the 'cpu' attention extension is unavailable: {_load_error}")
    start = time.perf_counter()
    try:
        _extension = _compile_and_import()
    except Exception as error:
        _load_error = error
        raise RuntimeError(f"the 'cpu' attention extension is unavailable: {error}") from error
    elapsed = time.perf_counter() - start
    if elapsed > 2:  # it compiled: say where the time went
        logger.info("'cpu' attention kernel built in %.1f s, cached in %s", elapsed, cache_dir())
    return _extension


def _compile_and_import() -> Any:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise RuntimeError("the CPU lacks AVX2 and FMA, which the kernel needs")
    from torch.utils.cpp_extension import load as load_extension

    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    # Registers the ops with the dispatcher (TORCH_LIBRARY) instead of importing a module.
    load_extension(
        name=_EXTENSION_NAME,
        sources=[str(source) for source in _SOURCES],
        extra_cflags=_CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
    )
    return torch.ops.pagedllm


def build() -> float:
    """Compile (or find) the extension now and print how long that took; returns seconds."""
    start = time.perf_counter()
    load()
    elapsed = time.perf_counter() - start
    print(f"pagedllm: 'cpu' attention kernel ready in {cache_dir()} ({elapsed:.1f} s)")
    return elapsed


def create_backend() -> AttentionBackend:
    """The "cpu" backend, or the "torch" one (with an error logged once per process) if the
    kernel cannot be built or loaded here."""
    global _fallback_logged
    try:
        return CpuAttentionBackend()
    except RuntimeError as error:
        if not _fallback_logged:
            logger.error("%s; falling back to attention_backend='torch'", error)
            _fallback_logged = True
        return TorchAttentionBackend()


@dataclass
class _Plan:
    """One step's metadata as the kernel takes it (built once per step, shared by layers)."""

    block_tables: torch.Tensor  # int32
    query_start_loc: torch.Tensor  # int32
    seq_lens: torch.Tensor  # int32


class CpuAttentionBackend(AttentionBackend):
    """Decodes and prefill chunks of any length run in the C++ kernel, straight from the
    paged blocks (it beats gather + SDPA at every chunk length measured, 2048 included:
    benchmarks/attention_kernel.py).

    Falls back to the torch backend for a whole call when the kernel does not cover it:
    caches other than fp32 / bf16 / fp16, head_dim not in the kernel's list (16, 32, 64,
    80, 96, 128, 256), or tensors not on the CPU. bf16 / fp16 caches are read as such and
    accumulated in fp32; queries are upcast to fp32 and the output cast back.
    """

    name = "cpu"

    def __init__(self) -> None:
        self._ops = load()
        self._head_dims = frozenset(self._ops.supported_head_dims())
        self._torch = TorchAttentionBackend()
        self._plan_metadata: AttentionMetadata | None = None
        self._plan: _Plan | None = None

    def forward(self, q, k, v, kv_cache, metadata, scale):
        if not self._covers(q, kv_cache[0]):
            return self._torch.forward(q, k, v, kv_cache, metadata, scale)
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        plan = self._plan_for(metadata)
        out = torch.empty(q.shape, dtype=torch.float32)
        query = q.float()  # no copy when q is fp32 already
        if query.stride(-1) != 1:  # the kernel takes any token/head strides, but not this
            query = query.contiguous()
        self._ops.paged_attention(
            out,
            query,
            kv_cache[0],
            kv_cache[1],
            plan.block_tables,
            plan.query_start_loc,
            plan.seq_lens,
            scale,
        )
        return out.to(q.dtype)

    def _covers(self, q: torch.Tensor, key_cache: torch.Tensor) -> bool:
        return (
            key_cache.dtype in _SUPPORTED_DTYPES
            and q.shape[-1] in self._head_dims
            and q.device.type == "cpu"
            and key_cache.device.type == "cpu"
        )

    def _plan_for(self, metadata: AttentionMetadata) -> _Plan:
        # Every layer of a step gets the same metadata object; convert it once.
        if metadata is not self._plan_metadata:
            self._plan = _Plan(
                block_tables=metadata.block_tables.to(torch.int32).contiguous(),
                query_start_loc=torch.tensor(metadata.query_start_loc, dtype=torch.int32),
                seq_lens=torch.tensor(metadata.seq_lens, dtype=torch.int32),
            )
            self._plan_metadata = metadata
        assert self._plan is not None
        return self._plan


if __name__ == "__main__":
    build()
