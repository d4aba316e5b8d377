"""The quantized KV cache (`kv_cache_dtype` int8, fp8 / fp8_e4m3, fp8_e5m2): storage and the
torch reference of its writes and reads.

A quantized pool entry is (K, V, K scale, V scale): K and V [blocks, block_size, Hkv, D] in
the 8-bit dtype, scales [blocks, block_size, Hkv] fp32, one per token and KV head (a block
fills token by token, so a scale per block could not be fixed in advance). A row x of D
values gets s = absmax(x) / QMAX and is stored as x * (QMAX / absmax(x)), clamped to +-QMAX
and rounded to nearest even (int8 by round, fp8 by its conversion); it reads back as q * s.
Other caches stay (K, V) pairs.

The C++ write (`write_kv_cache`) computes the same fp32 operations in the same order, so
both paths store the same bits; the kernel dequantizes in its inner loops
(`ops/csrc/paged_attention.cpp`) and the torch backend only the blocks it gathers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Storage dtype -> the largest magnitude a scaled row reaches (its absmax maps to it).
QUANT_MAX = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max),  # 448
    torch.float8_e5m2: float(torch.finfo(torch.float8_e5m2).max),  # 57344
}
SCALE_DTYPE = torch.float32

KVCache = tuple[torch.Tensor, ...]  # (K, V), or (K, V, K scale, V scale) when quantized


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANT_MAX


def bytes_per_row(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes one token's K (or V) of one KV head takes in the pool: its values, and its
    scale if the cache is quantized."""
    return head_dim * dtype.itemsize + (SCALE_DTYPE.itemsize if is_quantized(dtype) else 0)


def kv_cache_layout(
    shape: tuple[int, int, int, int], dtype: torch.dtype
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor of one layer's pool entry of `shape` [blocks,
    block_size, Hkv, D]: K and V, then a quantized cache's K and V scales."""
    layout = [(tuple(shape), dtype)] * 2
    if is_quantized(dtype):
        layout += [(tuple(shape[:-1]), SCALE_DTYPE)] * 2
    return layout


def kv_cache_entry(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
) -> KVCache:
    """One layer's pool entry (see `kv_cache_layout`), its tensors from `zeros`."""
    return tuple(zeros(s, d) for s, d in kv_cache_layout(shape, dtype))


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., D] -> (values [..., D] in `dtype`, fp32 scales [...])."""
    qmax = QUANT_MAX[dtype]
    x = x.float()
    absmax = x.abs().amax(dim=-1)
    scale = absmax / qmax
    # An all-zero row stores zeros with scale 0 (its inverse would be inf, and 0 * inf NaN).
    inverse = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))
    scaled = (x * inverse.unsqueeze(-1)).clamp(-qmax, qmax)
    if dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(dtype), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] * scale [...] in `dtype` (computed in fp32)."""
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


def storage_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as a dtype torch's indexing kernels take (fp8 has no index_copy_)."""
    is_fp8 = tensor.dtype.is_floating_point and tensor.itemsize == 1
    return tensor.view(torch.uint8) if is_fp8 else tensor
