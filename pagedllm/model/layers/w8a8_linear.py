"""8-bit checkpoint layers: int8 W8A8 on the int8 GEMM, FP8 (and weight-only int8) by
dequantizing a band of rows at a time. The weights stay 8-bit in memory in both.

`Int8W8A8Linear` (int8 weights, int8 activations): each call quantizes the activation
(`w8a8_activations.py`, per token by default) to integers q_x and multiplies them by the
weight's integers exactly, in int32, then scales by s_x * s_w. On VNNI CPUs that is
fbgemm's prepacked int8 GEMM (the `quantization="int8"` kernel): its input is q_x plus one
extra row holding -128 and 127, so that fbgemm's own per-tensor quantization of that input
has scale 1 and zero point 128 and reproduces q_x exactly (the extra row's output is
dropped). Without VNNI fbgemm adds u8 x s8 pairs in saturating int16, which full-range
inputs can overflow, so those CPUs take `torch._int_mm` (exact int32). Either way the result
is the reference's sum of (q_x s_x)(q_w s_w) up to fp32 rounding.

`TiledDequantLinear` (fp8 weights, or int8 weights with unquantized activations): the
activation is fake-quantized to the checkpoint's grid (values * scales, as fp32), then each
band of ~1 MiB of dequantized rows is made in fp32 and multiplied into its columns of the
output; only one band is ever held in fp32. Up to `fused_max_rows()` rows (decode: 4 on
AVX2, 32 on AVX-512) fp8 weights are instead dequantized in registers and multiplied there
(`fp8_linear`, ops/csrc/fp8_dequant.cpp), each weight the same fp32 value the band holds.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from pagedllm.model.layers.gguf_linear import _keep_bias
from pagedllm.model.layers.linear import MatmulIntoLinear, SplitOutputs
from pagedllm.model.layers.w8a8_activations import (
    INT8_MAX,
    INT8_MIN,
    fake_quantize,
    quantize_activations,
)
from pagedllm.model.layers.w8a8_weights import W8A8Weights, fp8_ops
from pagedllm.model.quantization.w8a8_scheme import INT8, W8A8Scheme
from pagedllm.ops.cpu_features import FP8_AVX2, FP8_AVX512, fp8_kernel_isa

BAND_BYTES = 1 << 20  # fp32 bytes of dequantized rows made at a time
# Up to this many input rows fp8 weights are multiplied in registers (`fp8_linear`: a byte
# read per weight), per kernel path; past it a band in fp32 and torch.mm took less time (one
# thread, Llama-3.2-1B's projections, benchmarks/fp8_kernel.py). AVX2 keeps its four
# registers' worth; AVX-512's passes of 8 rows beat the bands 1.3-2.8x at 8, 16 and 32 rows.
FUSED_MAX_ROWS = {FP8_AVX2: 4, FP8_AVX512: 32}
INT8_ENGINE = "fbgemm"


_SCRATCH: list[torch.Tensor] = [torch.empty(0)]


def _scratch(rows: int, cols: int) -> torch.Tensor:
    """One band's fp32 buffer, shared by every layer (the forward pass runs one at a time),
    so a band costs neither an allocation nor fresh pages. A normal tensor even when first
    made under `torch.inference_mode` (the engine's steps): an inference tensor could not
    be written outside it, as a layer called directly does."""
    if _SCRATCH[0].numel() < rows * cols:
        with torch.inference_mode(False):
            _SCRATCH[0] = torch.empty(rows * cols)
    return _SCRATCH[0][: rows * cols].view(rows, cols)


def fused_max_rows() -> int:
    """The most input rows this CPU's fp8 path multiplies in registers."""
    return FUSED_MAX_ROWS[fp8_kernel_isa()]


def use_fbgemm() -> bool:
    """fbgemm's int8 GEMM is exact on full-range inputs only with VNNI (see the module doc)."""
    is_vnni = getattr(torch.cpu, "_is_vnni_supported", None)
    supported = INT8_ENGINE in torch.backends.quantized.supported_engines
    return bool(supported and is_vnni is not None and is_vnni())


def _static_scale(weights: W8A8Weights) -> torch.Tensor | None:
    scale = weights.input_scale
    return None if scale is None else scale.to(torch.float32).reshape(1, 1)


class TiledDequantLinear(MatmulIntoLinear):
    """y = fakequant(x) W^T (+ b), W dequantized a band of rows at a time."""

    def __init__(self, weights: W8A8Weights, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weights = weights
        self.out_features, self.in_features = weights.values.shape
        self.register_buffer("values", weights.values)
        self.register_buffer("weight_scales", weights.scales)
        self.register_buffer("input_scale", _static_scale(weights))
        self.band_rows = max(1, BAND_BYTES // (4 * self.in_features))
        if weights.scheme.block is not None:  # whole blocks per band: no scale is cut
            rows = weights.scheme.block[0]
            self.band_rows = max(rows, self.band_rows // rows * rows)
        _keep_bias(self, bias)

    def matmul_into(self, x2: torch.Tensor, out: torch.Tensor) -> None:
        """out [rows, out_features] (rows may be strided) = fakequant(x2) W^T."""
        activations = self.weights.scheme.activations
        if activations is not None:
            x2 = fake_quantize(x2, activations, self.weights.scheme.weight_type, self.input_scale)
        ops = fp8_ops() if self.values.dtype == torch.float8_e4m3fn else None
        if ops is not None and x2.shape[0] <= fused_max_rows():
            weights = self.weights
            scales = weights.kernel_scales(0, self.out_features)
            ops.fp8_linear(out, x2, self.values, scales, *weights.kernel_blocks(), fp8_kernel_isa())
            return
        for start in range(0, self.out_features, self.band_rows):
            stop = min(start + self.band_rows, self.out_features)
            band = self.weights.dequantize_rows(
                start, stop, _scratch(stop - start, self.in_features)
            )
            torch.mm(x2, band.T, out=out[:, start:stop])

    def weight_bytes(self) -> int:
        return self.weights.nbytes()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.weights.scheme.describe()}"
        )


class Int8W8A8Linear(nn.Module):
    """y = (q_x q_w^T) s_x s_w (+ b), integers multiplied exactly (see the module docstring)."""

    def __init__(self, weights: W8A8Weights, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        assert weights.scheme.weight_type == INT8 and weights.scheme.block is None
        self.activations = weights.scheme.activations
        assert self.activations is not None, "weight-only int8 is a TiledDequantLinear"
        self.out_features, self.in_features = weights.values.shape
        self.register_buffer("input_scale", _static_scale(weights))
        self.register_buffer("weight_scales", weights.scales.reshape(-1).contiguous())
        self._packed = None
        self.register_buffer("values", None)
        if use_fbgemm():
            self._packed = _prepack(weights.values, self.weight_scales)
        else:
            self.values = weights.values
        self._range_row = torch.zeros(1, self.in_features)
        self._range_row[0, :2] = torch.tensor([INT8_MIN, INT8_MAX])
        _keep_bias(self, bias)

    forward = TiledDequantLinear.forward

    def matmul_into(self, x2: torch.Tensor, out: torch.Tensor) -> None:
        """out [rows, out_features] (rows may be strided) = x2 W^T, x2 quantized to int8."""
        q, x_scales = quantize_activations(x2, self.activations, INT8, self.input_scale)
        if self._packed is not None:
            with_range = torch.cat([q, self._range_row])
            product = torch.ops.quantized.linear_dynamic(with_range, self._packed, False)
            torch.mul(product[: q.shape[0]], x_scales, out=out)
        else:
            acc = torch._int_mm(q.to(torch.int8), self.values.T)
            torch.mul(acc.to(torch.float32).mul_(self.weight_scales), x_scales, out=out)

    def weight_bytes(self) -> int:
        """The int8 weight (fbgemm's packed copy holds the same bytes, its padding aside,
        and an int32 column offset per output) and the scales."""
        int8 = self.out_features * self.in_features
        offsets = 4 * self.out_features if self._packed is not None else 0
        return int8 + offsets + self.weight_scales.numel() * 4

    def extra_repr(self) -> str:
        kernel = "fbgemm" if self._packed is not None else "_int_mm"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"activations {self.activations.describe()}, {kernel}"
        )


def _prepack(values: torch.Tensor, scales: torch.Tensor):
    """fbgemm's packed form of int8 values [N, K] with per-channel scales [N]."""
    zero_points = torch.zeros(values.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # Quantized tensors are marked deprecated; they are fbgemm's only way in (torch 2.13).
        warnings.simplefilter("ignore", UserWarning)
        weight = torch._make_per_channel_quantized_tensor(values, scales.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(weight, None)


class TiledDequantMergedLinear(SplitOutputs, TiledDequantLinear):
    """A fused projection (q/k/v, gate/up) on stacked 8-bit weights; splits like fp32's."""


class Int8W8A8MergedLinear(SplitOutputs, Int8W8A8Linear):
    """A fused projection (q/k/v, gate/up) on stacked int8 weights; splits like fp32's."""


def on_int8_gemm(scheme: W8A8Scheme) -> bool:
    """Whether a scheme's layers multiply integers (`Int8W8A8Linear`), not bands."""
    return scheme.weight_type == INT8 and scheme.activations is not None


def w8a8_layer(
    weights: W8A8Weights,
    bias: torch.Tensor | None = None,
    output_sizes: list[int] | None = None,
) -> nn.Module:
    """The layer for one checkpoint layer's weights: int8 x int8 on the GEMM, else bands;
    with `output_sizes`, the fused projection's layer."""
    on_gemm = on_int8_gemm(weights.scheme)
    if output_sizes is None:
        return (Int8W8A8Linear if on_gemm else TiledDequantLinear)(weights, bias)
    layer = (Int8W8A8MergedLinear if on_gemm else TiledDequantMergedLinear)(weights, bias)
    layer.output_sizes = list(output_sizes)
    return layer
