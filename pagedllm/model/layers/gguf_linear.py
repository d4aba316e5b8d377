"""GGUF-quantized linear layers (`quantization="gguf"`): weights stay in the file's blocks.

Owns reading a Q4_0 / Q4_1 / Q8_0 tensor's raw blocks as (q, d, m) with w = d*q + m,
packing them into the tile layout of `torch.ops.pagedllm.gguf_linear`
(`ops/csrc/gguf_linear.cpp`), and `GGUFLinear` / `GGUFMergedLinear`. The weights are used
exactly as the file stores them (the fp32 engine dequantizes the same blocks), so the only
approximation is the input: each 32-wide block of an activation row becomes two int8 digits
with its own scale (~15 bits). That keeps greedy output on fp32's tokens where one digit
does not (benchmarks/int8_accuracy.py), at the price of two integer dot products per block.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.model.layers.linear import SplitOutputs
from pagedllm.ops.extension import load
from pagedllm.utils import round_up

BLOCK = 32
TILE_COLS = 8
# GGUF type -> (bytes per 32-weight block, bits the kernel stores per weight).
KERNEL_TYPES: dict[GGMLQuantizationType, tuple[int, int]] = {
    GGMLQuantizationType.Q4_0: (18, 4),
    GGMLQuantizationType.Q4_1: (20, 4),
    GGMLQuantizationType.Q8_0: (34, 8),
}
# Two int8 digits per activation; 1 is one digit (faster, and far from fp32's tokens).
DEFAULT_DIGITS = 2


def _fp16(raw: np.ndarray, offset: int) -> np.ndarray:
    return raw[:, :, offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """GGUF's 4-bit block: byte j holds element j (low nibble) and element j + 16 (high)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def unpack_blocks(
    raw: np.ndarray, ggml_type: GGMLQuantizationType
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q uint8 [N, K], d float32 [N, K/32], m float32 [N, K/32]) of a raw [N, row bytes]
    tensor, with every weight equal to d*q + m of its block."""
    if ggml_type not in KERNEL_TYPES:
        raise ValueError(f"GGUF type {ggml_type.name} has no quantized kernel")
    block_bytes, _ = KERNEL_TYPES[ggml_type]
    rows, row_bytes = raw.shape
    if row_bytes % block_bytes:
        raise ValueError(f"a {ggml_type.name} row of {row_bytes} bytes is not whole blocks")
    blocks = raw.reshape(rows, row_bytes // block_bytes, block_bytes)
    d = _fp16(blocks, 0)
    if ggml_type == GGMLQuantizationType.Q8_0:
        # Stored signed; the kernel multiplies unsigned weights, so q + 128 and m = -128 d.
        q = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        m = -128.0 * d
    elif ggml_type == GGMLQuantizationType.Q4_1:
        q, m = _nibbles(blocks[:, :, 4:]), _fp16(blocks, 2)
    else:  # Q4_0: w = d * (q - 8)
        q, m = _nibbles(blocks[:, :, 2:]), -8.0 * d
    return q.reshape(rows, -1), d, m.astype(np.float32)


def pack_weights(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout: columns in tiles of 8; per tile and block, groups of 4
    consecutive k for the tile's 8 columns (two groups per byte when 4-bit)."""
    rows, k = q.shape
    padded = round_up(rows, TILE_COLS)
    if padded != rows:  # zero columns, never written out
        q = torch.cat([q, q.new_zeros(padded - rows, k)])
        d = torch.cat([d, d.new_zeros(padded - rows, d.shape[1])])
        m = torch.cat([m, m.new_zeros(padded - rows, m.shape[1])])
    tiles, blocks = padded // TILE_COLS, k // BLOCK
    # [tile, col, block, group, 4] -> [tile, block, group, col, 4]
    grouped = q.reshape(tiles, TILE_COLS, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    if bits == 4:
        grouped = grouped[:, :, :4] | (grouped[:, :, 4:] << 4)
    packed = grouped.contiguous().reshape(-1)

    def per_tile(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(tiles, TILE_COLS, blocks).permute(0, 2, 1).contiguous()

    return packed, per_tile(d.float()), per_tile(m.float())


class GGUFLinear(nn.Module):
    """y = x W^T (+ b) with W in GGUF blocks, computed by the gguf_linear kernel."""

    def __init__(
        self,
        raw: np.ndarray,
        ggml_type: GGMLQuantizationType,
        bias: torch.Tensor | None = None,
        digits: int = DEFAULT_DIGITS,
    ) -> None:
        super().__init__()
        q, d, m = unpack_blocks(raw, ggml_type)
        self.out_features, self.in_features = q.shape
        self.ggml_type = ggml_type
        self.bits = KERNEL_TYPES[ggml_type][1]
        self.digits = digits
        self.allow_vnni = True  # tests turn it off to check the portable path
        self._ops = load()
        packed, scales, mins = pack_weights(
            torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m), self.bits
        )
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty((x2.shape[0], self.out_features), dtype=torch.float32)
        self._ops.gguf_linear(
            out, x2, self.packed, self.scales, self.mins, self.bits, self.digits, self.allow_vnni
        )
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*leading, self.out_features)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"type={self.ggml_type.name}, digits={self.digits}"
        )


class GGUFMergedLinear(SplitOutputs, GGUFLinear):
    """Fused q/k/v or gate/up in GGUF blocks; splits its output like the fp32 layer."""

    def __init__(
        self,
        raw: np.ndarray,
        ggml_type: GGMLQuantizationType,
        output_sizes: list[int],
        bias: torch.Tensor | None = None,
        digits: int = DEFAULT_DIGITS,
    ) -> None:
        super().__init__(raw, ggml_type, bias, digits)
        self.output_sizes = list(output_sizes)
