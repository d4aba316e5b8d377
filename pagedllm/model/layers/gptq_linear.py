"""Linear layers on a checkpoint's packed integer weights (GPTQ, AWQ and compressed-tensors
pack-quantized: all read into `UnpackedGPTQ`), kept 4- or 8-bit and multiplied by the GGUF
block kernel (`torch.ops.pagedllm.gguf_linear`, `ops/csrc/gguf_linear.cpp`).

A group's weights are w = scale * (q - zero) = d * q + m with d = scale and m = -scale * zero:
the kernel's Q4_1 form, its 4-bit q in the same tile layout (8-bit q: Q8_0's layout, with a
min of its own). The kernel keeps one d and m per group of 2^shift blocks of 32 inputs
(`scale_shift`), d as the checkpoint's fp16 or bf16 and m as the uint8 zero point it
multiplies by d (`packed_tables.py`): 3 bytes a group and column where the checkpoint
stores ~2.5, exact for fp16 and bf16 scales (an 11- or 8-bit significand times an integer
below 2^8); an fp32 scale's m is rounded once (2^-24). When every zero point is the
midpoint 2^(bits-1) (symmetric schemes) the layer keeps no min table: the kernel derives
m = -2^(bits-1) d, as for Q4_0 / Q8_0. As for GGUF, the only approximation is the input:
each 32-wide block of an activation row becomes two int8 digits with its own scale
(~15 bits).

Act-order layers keep their input order and gather the activation's columns by it first.
A fused projection whose parts have different orders is one layer per part, writing its
columns of one output (`GGUFConcatLinear`).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.layers.gguf_linear import (
    BLOCK,
    DEFAULT_DIGITS,
    GGUFConcatLinear,
    _keep_bias,
    distinct_bytes,
)
from pagedllm.model.layers.linear import MatmulIntoLinear, SplitOutputs
from pagedllm.model.layers.packed_tables import kernel_tables
from pagedllm.model.quantization.gptq_format import UnpackedGPTQ
from pagedllm.ops.cpu_features import gguf_kernel_isa
from pagedllm.ops.extension import load


def scale_shift(in_features: int, group_size: int) -> int:
    """log2 of the kernel blocks per group; for one group a row, a shift that maps every
    block to group 0."""
    blocks = in_features // BLOCK
    if group_size == in_features:
        return (blocks - 1).bit_length()
    return (group_size // BLOCK).bit_length() - 1


def stack_parts(parts: list[UnpackedGPTQ]) -> UnpackedGPTQ:
    """The parts of a fused projection (the same input order) as one layer's weights."""
    return UnpackedGPTQ(
        _stack_rows([p.q for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]),
        parts[0].order,
        parts[0].group_size,
        parts[0].bits,
    )


def _stack_rows(qs: list[torch.Tensor]) -> torch.Tensor:
    """The parts' q [N_i, K] as one [sum N_i, K]. Transposed views (GPTQ's, AWQ's q) are
    joined as the [K, N_i] they view: a copy through their strides took ~10x longer."""
    if all(q.stride(0) == 1 for q in qs):
        return torch.cat([q.T for q in qs], dim=1).T
    return torch.cat(qs)


class GPTQLinear(MatmulIntoLinear):
    """y = x W^T (+ b) with W a checkpoint's packed weights (see the module docstring)."""

    def __init__(
        self, weights: UnpackedGPTQ, bias: torch.Tensor | None = None, digits: int = DEFAULT_DIGITS
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weights.q.shape
        if self.in_features % BLOCK:
            raise ValueError(f"GPTQ: {self.in_features} inputs are not whole blocks of {BLOCK}")
        self.bits = weights.bits
        packed, scales, mins = kernel_tables(weights)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)  # fp16 / bf16 where exact, else fp32
        self.register_buffer("mins", mins)  # uint8 zero points, fp32 mins, or empty
        order = weights.order
        self.register_buffer("order", None if order is None else order.to(torch.int32))
        self.group_size = weights.group_size
        self.scale_shift = scale_shift(self.in_features, weights.group_size)
        self.digits = digits
        self.isa = gguf_kernel_isa()  # the widest path; tests lower it
        self._ops = load()
        _keep_bias(self, bias)

    def matmul_into(self, x2: torch.Tensor, out: torch.Tensor) -> None:
        """out [rows, out_features] (rows may be strided) = x2 [rows, in_features] W^T."""
        if self.order is not None:
            x2 = x2.index_select(1, self.order)
        self._ops.gguf_linear(
            out, x2, self.packed, self.scales, self.mins, self.bits, self.digits, self.isa,
            self.scale_shift,
        )  # fmt: skip

    def weight_bytes(self) -> int:
        return distinct_bytes(t for n, t in self.named_buffers() if n != "bias")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, act_order={self.order is not None}"
        )


class GPTQMergedLinear(SplitOutputs, GPTQLinear):
    """Fused q/k/v or gate/up on GPTQ weights; splits its output like the fp32 layer."""

    def __init__(
        self,
        weights: UnpackedGPTQ,
        output_sizes: list[int],
        bias: torch.Tensor | None = None,
        digits: int = DEFAULT_DIGITS,
    ) -> None:
        super().__init__(weights, bias, digits)
        self.output_sizes = list(output_sizes)


def merged_gptq_layer(
    parts: list[UnpackedGPTQ], output_sizes: list[int], bias: torch.Tensor | None
) -> nn.Module:
    """One kernel layer when the parts share an input order, else one per part."""
    first = parts[0].order
    same_order = all(
        (p.order is None and first is None)
        or (p.order is not None and first is not None and torch.equal(p.order, first))
        for p in parts
    )
    if same_order and len({(p.group_size, p.bits) for p in parts}) == 1:
        return GPTQMergedLinear(stack_parts(parts), output_sizes, bias)
    return GGUFConcatLinear([GPTQLinear(p) for p in parts], output_sizes, bias)
