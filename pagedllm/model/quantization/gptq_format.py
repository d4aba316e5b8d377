"""GPTQ's packed tensors (AutoGPTQ / GPTQModel layout), read into integers and scales.

Per quantized linear layer of K inputs and N outputs a checkpoint holds
- `qweight` int32 [K/8, N]: eight 4-bit weights per int32 along the input rows, row k in
  bits 4 * (k % 8) of row k // 8;
- `qzeros` int32 [G, N/8]: the zero points packed the same way along the outputs, stored
  minus 1 in the v1 ("gptq") layout, as they are in "gptq_v2";
- `scales` fp16 [G, N]; `g_idx` int32 [K]: the group of each input row.
Weight [n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = g_idx[k].

With act-order (`desc_act`) g_idx assigns input rows to groups out of order. `unpack_gptq`
reorders the input rows so that each group is G consecutive rows, and returns the order;
the layer applies it to the activations (x[:, order] @ W[:, order]^T = x @ W^T), so the
kernel sees contiguous groups. Nothing here rounds: q and zero are integers, the scales are
the stored fp16 values, and the layer's fp32 tables hold scale and -scale * zero exactly
(an 11-bit significand times an integer below 32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.model.quantization.gptq import PER_CHANNEL, GPTQConfig

PACKED_PER_INT32 = 8  # 4-bit values in one int32
TENSOR_NAMES = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class GPTQTensors:
    """One layer's tensors as the checkpoint stores them."""

    qweight: torch.Tensor  # int32 [K/8, N]
    qzeros: torch.Tensor  # int32 [G, N/8]
    scales: torch.Tensor  # fp16 [G, N]
    g_idx: torch.Tensor | None  # int32 [K]; absent in some checkpoints without act-order

    def nbytes(self) -> int:
        tensors = [self.qweight, self.qzeros, self.scales, self.g_idx]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(frozen=True)
class UnpackedGPTQ:
    """A layer's weights as integers, input rows in the order the kernel reads them."""

    q: torch.Tensor  # uint8 [N, K], below 2^bits; any strides (GPTQ, AWQ: a transposed view)
    scales: torch.Tensor  # float32 [N, G]
    zeros: torch.Tensor  # float32 [N, G], integers
    order: torch.Tensor | None  # int64 [K]: kernel input j is checkpoint input order[j]
    group_size: int  # input rows per group (K per channel)
    bits: int = 4  # q below 2^bits (8: compressed-tensors W8A16)

    @property
    def symmetric(self) -> bool:
        """Every zero point is the midpoint 2^(bits-1): the kernel derives the min from the
        scale and the layer keeps no min table."""
        return bool((self.zeros == 2 ** (self.bits - 1)).all())

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] in the checkpoint's input order: exact (see the module docstring)."""
        scales = self.scales.repeat_interleave(self.group_size, dim=1)
        zeros = self.zeros.repeat_interleave(self.group_size, dim=1)
        weight = scales * (self.q.float() - zeros)
        if self.order is None:
            return weight
        restored = torch.empty_like(weight)
        restored[:, self.order] = weight
        return restored


def _word_values(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, C, 32 / bits]: each word's values, lowest bits first. Read
    through the words' bytes (little-endian, as every CPU the kernels build for), never
    widened to int32: a Llama-3.2-1B layer's unpacking took 4x longer through int32 shifts."""
    word_bytes = packed.contiguous().view(torch.uint8).reshape(*packed.shape, 4)
    if bits == 8:
        return word_bytes
    return torch.stack((word_bytes & 0xF, word_bytes >> 4), dim=-1).reshape(*packed.shape, 8)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [8R, C]: row r of the result is bits 4 * (r % 8) of row r // 8.
    The nibbles are split from the words' bytes laid out [R, 4, C], so the one copy writes
    the result's rows in order (3x faster than splitting first and permuting after)."""
    rows, cols = packed.shape
    word_bytes = packed.contiguous().view(torch.uint8).reshape(rows, cols, 4).permute(0, 2, 1)
    return torch.stack((word_bytes & 0xF, word_bytes >> 4), dim=2).reshape(8 * rows, cols)


def unpack_columns(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, (32 / bits) C]: with p = 32 / bits values a word, column c
    is bits `bits * (c % p)` up of column c // p (4 or 8 bits, which never straddle words)."""
    return _word_values(packed, bits).reshape(packed.shape[0], -1)


def input_order(g_idx: torch.Tensor | None, rows: int, group_size: int) -> torch.Tensor | None:
    """None when input row k is in group k // group_size already; else the order of input
    rows that makes each group consecutive (stable: rows keep their order in a group)."""
    contiguous = torch.arange(rows) // group_size
    if g_idx is None or torch.equal(g_idx.long(), contiguous):
        return None
    order = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[order], contiguous):
        raise ValueError(
            f"GPTQ g_idx does not give every group {group_size} input rows: not a GPTQ layout"
        )
    return order


def checked_group_size(
    scales: torch.Tensor, rows: int, cols: int, group_size: int, fmt: str
) -> int:
    """The inputs per group (`PER_CHANNEL`: all `rows`), once `scales` is seen to hold one
    row per group of a [rows, cols] layer; raises ValueError naming the format otherwise."""
    size = rows if group_size == PER_CHANNEL else group_size
    if rows % size or scales.shape != (rows // size, cols):
        raise ValueError(
            f"{fmt} scales {tuple(scales.shape)} do not fit {rows} inputs x {cols} outputs "
            f"in groups of {size}"
        )
    return size


def _packed_zeros(qzeros: torch.Tensor, groups: int, cols: int) -> torch.Tensor:
    """qzeros once seen to be int32 [groups, ceil(cols / 8)]: checked before any column is
    cut, since the first columns of words of another layout are other values."""
    shape = (groups, -(-cols // PACKED_PER_INT32))
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != shape:
        raise ValueError(
            f"GPTQ qzeros is {qzeros.dtype} {tuple(qzeros.shape)}, not torch.int32 {shape}"
        )
    return qzeros


def unpack_gptq(tensors: GPTQTensors, config: GPTQConfig) -> UnpackedGPTQ:
    """The integers and scales of one layer (see the module docstring)."""
    q = unpack_rows(tensors.qweight)  # [K, N]
    rows, cols = q.shape
    group_size = checked_group_size(tensors.scales, rows, cols, config.group_size, "GPTQ")
    zeros = unpack_columns(_packed_zeros(tensors.qzeros, rows // group_size, cols))
    zeros = zeros[:, :cols].float() + config.zero_offset
    order = input_order(tensors.g_idx, rows, group_size)
    if order is not None:
        q = q[order]
    # q as a transposed view: the packer reads it as it lies (pack_q_tiles).
    return UnpackedGPTQ(
        q.T, tensors.scales.float().T.contiguous(), zeros.T.contiguous(), order, group_size
    )
