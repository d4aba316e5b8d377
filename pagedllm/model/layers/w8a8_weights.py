"""One 8-bit layer's weights as a checkpoint stores them (int8 or float8_e4m3fn values and
fp32 scales), dequantized a band of output rows at a time.

w[n, k] = q[n, k] * s, with s per output channel (a per-tensor scale is kept per channel),
or per block of [bn, bk] (s = scales[n // bn, k // bk]). The product is taken in fp32, one
rounding as in the format's own fp32 dequantization, and none at all when the scale comes
from bf16 or fp16 (an int8 or e4m3 value times an 8- or 11-bit significand fits in 24 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.model.quantization.w8a8_scheme import W8A8Scheme
from pagedllm.ops.cpu_features import fp8_kernel_isa

_KERNEL: list = []  # [torch.ops.pagedllm or None], filled on first use


def fp8_ops():
    """`torch.ops.pagedllm` (fp8_dequant, fp8_linear), or None where the CPU extension does
    not load."""
    if not _KERNEL:
        from pagedllm.ops.extension import available, load

        _KERNEL.append(load() if available() else None)
    return _KERNEL[0]


def fp8_kernel():
    """`torch.ops.pagedllm.fp8_dequant`, or None where the CPU extension does not load."""
    ops = fp8_ops()
    return None if ops is None else ops.fp8_dequant


@dataclass(frozen=True)
class W8A8Weights:
    """A layer's quantized weight, its scales and its static input scale (if any)."""

    values: torch.Tensor  # int8 or float8_e4m3fn [N, K]
    scales: torch.Tensor  # fp32 [N, 1], or [ceil(N / bn), ceil(K / bk)] for blocks
    scheme: W8A8Scheme
    input_scale: torch.Tensor | None = None  # fp32 scalar: static activations

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.values.shape[1]

    def nbytes(self) -> int:
        tensors = (self.values, self.scales, self.input_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def row_scales(self, start: int, stop: int) -> torch.Tensor:
        """The scales of output rows [start, stop), broadcastable to their [rows, K]."""
        if self.scheme.block is None:
            return self.scales[start:stop]
        rows, cols = self.scheme.block
        first, skip = divmod(start, rows)
        band = self.scales[first : -(-stop // rows)].repeat_interleave(rows, dim=0)
        return band[skip : skip + stop - start].repeat_interleave(cols, dim=1)[
            :, : self.in_features
        ]

    def dequantize_rows(
        self, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """fp32 [stop - start, K]: rows [start, stop) of the dequantized weight (exact), into
        `out` when given. fp8 bands go through the `fp8_dequant` kernel where it loads (a
        band of blocks must start on a block's first row); the rest through torch."""
        if out is None:
            out = torch.empty(stop - start, self.in_features)
        kernel = fp8_kernel() if self.values.dtype == torch.float8_e4m3fn else None
        if kernel is not None and start % self.kernel_blocks()[0] == 0:
            scales = self.kernel_scales(start, stop)
            kernel(out, self.values[start:stop], scales, *self.kernel_blocks(), fp8_kernel_isa())
            return out
        torch.mul(self.values[start:stop].to(torch.float32), self.row_scales(start, stop), out=out)
        return out

    def kernel_blocks(self) -> tuple[int, int]:
        """(rows, columns) one scale covers, as the fp8 kernels take them."""
        return self.scheme.block or (1, self.in_features)

    def kernel_scales(self, start: int, stop: int) -> torch.Tensor:
        """The scales of rows [start, stop) as the kernels read them (start on a block)."""
        rows = self.kernel_blocks()[0]
        return self.scales[start // rows : -(-stop // rows)]

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_rows(0, self.out_features)


def stack_weights(parts: list[W8A8Weights]) -> W8A8Weights:
    """The parts of a fused projection as one layer's weights (`can_stack` said they fit)."""
    first = parts[0]
    return W8A8Weights(
        torch.cat([p.values for p in parts]),
        torch.cat([p.scales for p in parts]),
        first.scheme,
        first.input_scale,
    )


def can_stack(parts: list[W8A8Weights]) -> bool:
    """Whether fused parts can be one layer: the same scheme and static input scale, and
    with blocks, every part but the last whole blocks of output rows."""
    first = parts[0]
    if any(p.scheme != first.scheme for p in parts):
        return False
    scales = [p.input_scale for p in parts]
    if any(s is not None for s in scales) and not all(
        s is not None and torch.equal(s, scales[0]) for s in scales
    ):
        return False
    if first.scheme.block is None:
        return True
    rows = first.scheme.block[0]
    return all(p.out_features % rows == 0 for p in parts[:-1])
