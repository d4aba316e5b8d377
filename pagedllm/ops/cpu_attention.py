"""The "cpu" attention backend: a C++/OpenMP kernel that reads K/V in place from the paged cache.

`CpuAttentionBackend` calls the kernel (pagedllm/ops/csrc/paged_attention.cpp) for every
step; building and loading the extension belong to `pagedllm.ops.extension`.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.ops.attention import (
    AttentionBackend,
    TorchAttentionBackend,
    write_kv_cache,
)
from pagedllm.ops.extension import load

logger = logging.getLogger(__name__)

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_fallback_logged = False


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

    def forward(self, q, k, v, kv_cache, metadata, scale):
        if not self._covers(q, kv_cache[0]):
            return self._torch.forward(q, k, v, kv_cache, metadata, scale)
        self._write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=torch.float32)
        query = q.float()  # no copy when q is fp32 already
        if query.stride(-1) != 1:  # the kernel takes any token/head strides, but not this
            query = query.contiguous()
        self._ops.paged_attention(
            out,
            query,
            kv_cache[0],
            kv_cache[1],
            metadata.kernel_block_tables,
            metadata.kernel_query_start_loc,
            metadata.kernel_seq_lens,
            scale,
        )
        return out.to(q.dtype)

    def _write_kv_cache(self, k, v, kv_cache, slots: torch.Tensor) -> None:
        key_cache = kv_cache[0]
        if all(
            t.dtype in (key_cache.dtype, torch.float32)
            and t.stride(-1) == 1
            and t.stride(-2) == t.shape[-1]
            for t in (k, v)
        ):
            self._ops.write_kv_cache(key_cache, kv_cache[1], k, v, slots.to(torch.int64))
        else:
            write_kv_cache(k, v, kv_cache, slots)

    def _covers(self, q: torch.Tensor, key_cache: torch.Tensor) -> bool:
        return (
            key_cache.dtype in _SUPPORTED_DTYPES
            and q.shape[-1] in self._head_dims
            and q.device.type == "cpu"
            and key_cache.device.type == "cpu"
        )
