"""The "cpu" attention backend: a C++/OpenMP kernel that reads K/V in place from the paged
cache, and its metadata (the layout as int32 tensors, nothing else).

`CpuAttentionBackend` calls the kernel (pagedllm/ops/csrc/paged_attention.cpp) for every
step; building and loading the extension belong to `pagedllm.ops.extension`, and whether
this backend serves a model at all to `pagedllm.ops.kernel_selection`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.ops.attention import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadata,
    to_device,
    write_kv_cache,
)
from pagedllm.ops.extension import load

# The cache dtypes the kernel reads (bf16 / fp16 accumulate in fp32; int8 / fp8 dequantized
# by their scales in the inner loops: ops/kv_quant.py).
SUPPORTED_CACHE_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)

# The engines a bf16 cache's tiles may run on (None: the vector kernel's own loops).
TILE_ENGINES = (None, "amx", "bf16_dots")


def kernel_covers(head_dim: int, cache_dtype: torch.dtype) -> bool:
    """Whether the kernel serves a model of this head size and KV cache dtype (loads the
    extension, which must be available)."""
    return cache_dtype in SUPPORTED_CACHE_DTYPES and head_dim in load().supported_head_dims()


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    # Only tensors: a compiled forward does not specialize on them.
    block_tables: torch.Tensor  # [num_reqs, max(2, max_num_blocks)] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32


class CpuAttentionBackend(AttentionBackend):
    """Decodes and prefill chunks of any length run in the C++ kernel, straight from the
    paged blocks (it beats gather + SDPA at every chunk length measured, 2048 included:
    benchmarks.attention_kernel).

    Serves fp32 / bf16 / fp16 / int8 / fp8 caches and the kernel's head sizes (16, 32, 64,
    80, 96, 128, 256) on the CPU, which `kernel_covers` checks once, when the kernels are
    chosen; 16- and 8-bit caches are read as such (8-bit ones times their rows' scales) and
    accumulated in fp32; bf16 queries and outputs are converted inside the kernel, others'
    upcast to fp32 and the output cast back.
    """

    name = "cpu"
    traceable = True

    def __init__(self, tiles: str | None = None) -> None:
        """`tiles`: a bf16 cache's prefill tiles and decodes run on tiles
        (ops/csrc/attention_amx.h: bf16 weights as Transformers' bf16 attention multiplies
        them, not the fp32 ones of the vector kernel), where the kernel covers the head and
        block sizes (and a decode's group of query heads fits a tile): "amx" on AMX where
        Linux grants the tile data, "bf16_dots" on AVX512-BF16 dot products doing the
        tiles' work (ops/csrc/attention_dots.h); the caller checks that the CPU has them."""
        if tiles not in TILE_ENGINES:
            raise ValueError(f"tiles must be one of {TILE_ENGINES}, not {tiles!r}")
        self._ops = load()
        self.tiles = tiles

    def build_metadata(self, layout: AttentionLayout, device: torch.device) -> CpuAttentionMetadata:
        tables = to_device(layout.block_tables, device, torch.int32)
        if tables.shape[1] < 2:
            # At least two columns (the null block pads): torch.compile specializes a size
            # of 1 and would compile another graph for the steps whose contexts fit a block.
            tables = F.pad(tables, (0, 2 - tables.shape[1]))
        return CpuAttentionMetadata(
            slot_mapping=to_device(layout.slot_mapping, device, torch.int64),
            block_tables=tables.contiguous(),
            query_start_loc=to_device(layout.query_start_loc, device, torch.int32),
            seq_lens=to_device(layout.seq_lens, device, torch.int32),
        )

    def forward(
        self, q, k, v, kv_cache, metadata: CpuAttentionMetadata, scale, sliding_window=None
    ):
        self._write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        # A bf16 model's queries are read and its output written in bf16 by the kernel
        # itself; other dtypes go through fp32 (no copy when q is fp32 already).
        io_dtype = q.dtype if q.dtype == torch.bfloat16 else torch.float32
        out = torch.empty(q.shape, dtype=io_dtype)
        query = q.to(io_dtype)
        if query.stride(-1) != 1:  # the kernel takes any token/head strides, but not this
            query = query.contiguous()
        self._ops.paged_attention(
            out,
            query,
            kv_cache[0],
            kv_cache[1],
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            scale,
            sliding_window or 0,
            *kv_cache[2:],  # a quantized cache's key and value scales
            tiles=self.tiles or "none",
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
            self._ops.write_kv_cache(key_cache, kv_cache[1], k, v, slots, *kv_cache[2:])
        else:
            write_kv_cache(k, v, kv_cache, slots)
