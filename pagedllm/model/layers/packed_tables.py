"""The kernel's tables for one layer of a packed checkpoint (GPTQ, AWQ, compressed-tensors),
from its unpacked integers and scales (`UnpackedGPTQ`).

- q in the kernel's tile layout, built in one C++ pass (`pack_q_tiles`, ops/csrc/gguf_pack.cpp;
  `gguf_linear.pack_q` is the torch reference it is held to);
- each group's scale d in the narrowest float type that holds every one exactly: fp16 or
  bf16 (what the checkpoints store), else fp32;
- each group's min m = -d * zero as the zero point itself, uint8, which the kernel multiplies
  by d (exact: at most an 11-bit significand times an integer below 2^8); no table at all
  when every zero point is the midpoint (the kernel derives m = -2^(bits-1) d).

So a group of 32 weights costs 16 bytes of q plus 3 of tables a column, where fp32 d and m
took 8: the checkpoint's ~18.5. The kernel's sums are those of fp32 tables, bit for bit
(ops/csrc/gguf_scales.h).
"""

from __future__ import annotations

import torch

from pagedllm.model.layers.gguf_linear import (
    _NO_MINS,
    BLOCK,
    TILE_BLOCK_BYTES,
    TILE_COLS,
    per_tile,
)
from pagedllm.model.quantization.gptq_format import UnpackedGPTQ
from pagedllm.ops.extension import load
from pagedllm.utils import round_up

# Narrower float types the kernel reads a scale table in, tried in this order.
_COMPACT_SCALE_TYPES = (torch.float16, torch.bfloat16)
_ZERO_POINT_LIMIT = 256  # zero points below this are kept as uint8


def pack_q_tiles(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q uint8 [N, K] (any strides, values below 2^bits; bits 4 or 8) in the kernel's tile
    layout: the bytes of `gguf_linear.pack_q`."""
    tiles, blocks = round_up(q.shape[0], TILE_COLS) // TILE_COLS, q.shape[1] // BLOCK
    packed = torch.empty(tiles * blocks * TILE_BLOCK_BYTES[bits], dtype=torch.uint8)
    load().pack_q_tiles(q, bits, packed)
    return packed


def compact_scales(scales: torch.Tensor) -> torch.Tensor:
    """fp32 `scales` as fp16 or bf16 where that holds every value exactly, else as they are."""
    for dtype in _COMPACT_SCALE_TYPES:
        narrow = scales.to(dtype)
        if torch.equal(narrow.float(), scales):
            return narrow
    return scales


def min_table(weights: UnpackedGPTQ) -> torch.Tensor:
    """The layer's `mins` buffer per tile: empty when symmetric, uint8 zero points when they
    are integers below 256, else fp32 m = -d * zero."""
    if weights.symmetric:
        return _NO_MINS
    zeros = weights.zeros
    if bool(((zeros >= 0) & (zeros < _ZERO_POINT_LIMIT) & (zeros == zeros.round())).all()):
        return per_tile(zeros.to(torch.uint8))
    return per_tile(-weights.scales * zeros)


def kernel_tables(weights: UnpackedGPTQ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed q, scales, mins) as the kernel reads them (see the module docstring)."""
    packed = pack_q_tiles(weights.q, weights.bits)
    return packed, per_tile(compact_scales(weights.scales)), min_table(weights)
