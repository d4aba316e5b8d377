"""Activations quantized on every call for the 8-bit layers (`w8a8_linear.py`): the scale of
each token (or group, or the whole input) and the quantized values, as the serving math of
int8 W8A8 and FP8 checkpoints defines them.

int8: scale = max |x| / 127, q = round(x / scale) (half to even), clamped to [-128, 127].
fp8 e4m3: scale = max |x| / 448, q = fp8(clamp(x / scale, -448, 448)) (the conversion rounds
to nearest even); a dynamic scale is kept at least 1 / (448 * 512), as the reference
kernels keep it, so that an all-zero row divides by something.
A static scale is the checkpoint's `input_scale`, the same for every token.
"""

from __future__ import annotations

import torch

from pagedllm.model.quantization.w8a8_scheme import INT8, PER_GROUP, PER_TENSOR, ActivationScheme

INT8_MAX = 127.0
INT8_MIN = -128.0
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
MIN_FP8_SCALE = 1.0 / (FP8_MAX * 512)
TINY = torch.finfo(torch.float32).tiny


def type_max(weight_type: str) -> float:
    return INT8_MAX if weight_type == INT8 else FP8_MAX


def dynamic_scales(x: torch.Tensor, scheme: ActivationScheme, weight_type: str) -> torch.Tensor:
    """fp32 scales broadcastable against `x` [rows, K] (or [rows, groups, size] for groups)."""
    if scheme.strategy == PER_TENSOR:
        amax = x.abs().amax().reshape(1, 1)
    else:
        amax = x.abs().amax(dim=-1, keepdim=True)
    floor = TINY if weight_type == INT8 else MIN_FP8_SCALE
    return (amax / type_max(weight_type)).clamp_min_(floor)


def quantize_values(x: torch.Tensor, scales: torch.Tensor, weight_type: str) -> torch.Tensor:
    """x / scale on the type's grid, as fp32 (integers for int8, fp8 values for fp8)."""
    scaled = x / scales
    if weight_type == INT8:
        return scaled.round_().clamp_(INT8_MIN, INT8_MAX)
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def quantize_activations(
    x: torch.Tensor,
    scheme: ActivationScheme,
    weight_type: str,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values on the grid, scales) for x [rows, K]: x ~ values * scales. Per-group scales
    come back expanded to [rows, K]; the others broadcast ([rows, 1] or [1, 1])."""
    if not scheme.dynamic:
        assert static_scale is not None, "a static activation scheme needs input_scale"
        scales = static_scale.reshape(1, 1)
        return quantize_values(x, scales, weight_type), scales
    if scheme.strategy != PER_GROUP:
        scales = dynamic_scales(x, scheme, weight_type)
        return quantize_values(x, scales, weight_type), scales
    rows, cols = x.shape
    grouped = x.reshape(rows, cols // scheme.group_size, scheme.group_size)
    scales = dynamic_scales(grouped, scheme, weight_type)
    values = quantize_values(grouped, scales, weight_type).reshape(rows, cols)
    return values, scales.expand_as(grouped).reshape(rows, cols)


def fake_quantize(
    x: torch.Tensor,
    scheme: ActivationScheme,
    weight_type: str,
    static_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x as the matmul sees it: values * scales, fp32 [rows, K]."""
    values, scales = quantize_activations(x, scheme, weight_type, static_scale)
    return values.mul_(scales)
