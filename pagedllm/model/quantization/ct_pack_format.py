"""compressed-tensors' `pack-quantized` tensors, read into the integers and scales GPTQ's
are read into.

Per quantized linear layer of K inputs and N outputs a checkpoint holds
- `weight_packed` int32 [N, K * bits / 32]: each output row's values packed densely along
  the inputs, value k at bit `bits * k` of the row (4 bits: 8 a word, 8 bits: 4 a word),
  stored as q + 2^(bits-1) (the signed integer made unsigned);
- `weight_scale` [N, G] in the model's dtype (G = K / group_size, or 1 per channel);
- `weight_zero_point` (asymmetric only) int32 [N * bits / 32, G]: the signed zero points
  offset and packed the same way but along the outputs; symmetric schemes store none
  (zero point 0, so 2^(bits-1) once offset);
- `weight_shape` int [2]: (N, K); `weight_g_idx` int32 [K] with group activation order.
Weight [n, k] = scale[n, g] * (q[n, k] - zero[n, g]) with g = k // group_size (g_idx[k]),
q and zero both read offset, as the stored bits are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.model.quantization.ct_pack_quantized import PackedScheme
from pagedllm.model.quantization.gptq import PER_CHANNEL
from pagedllm.model.quantization.gptq_format import UnpackedGPTQ, input_order, unpack_columns

TENSOR_NAMES = (
    "weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx",
)  # fmt: skip
REQUIRED = TENSOR_NAMES[:3]


@dataclass(frozen=True)
class PackedTensors:
    """One layer's tensors as the checkpoint stores them."""

    weight_packed: torch.Tensor  # int32 [N, K * bits / 32]
    weight_scale: torch.Tensor  # [N, G]
    weight_shape: torch.Tensor  # [2]: N, K
    weight_zero_point: torch.Tensor | None = None  # int32 [N * bits / 32, G]
    weight_g_idx: torch.Tensor | None = None  # int32 [K]

    def nbytes(self) -> int:
        tensors = [getattr(self, name) for name in TENSOR_NAMES]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _packed_words(tensor: torch.Tensor, name: str, shape: tuple[int, int]) -> torch.Tensor:
    """`tensor` once seen to be int32 of exactly `shape`: never trimmed to fit, since the
    first columns of words of another width or layout are other values."""
    if tensor.dtype != torch.int32 or tuple(tensor.shape) != shape:
        raise ValueError(f"{name} is {tensor.dtype} {tuple(tensor.shape)}, not torch.int32 {shape}")
    return tensor


def _words(values: int, bits: int) -> int:
    return -(-values * bits // 32)


def layer_shape(weight_shape: torch.Tensor) -> tuple[int, int]:
    """(N, K) from weight_shape: two positive integers."""
    values = weight_shape.tolist() if not weight_shape.is_floating_point() else None
    if not (isinstance(values, list) and len(values) == 2 and min(values) > 0):
        raise ValueError(f"weight_shape {weight_shape.tolist()} is not two positive integers")
    return int(values[0]), int(values[1])


def _zero_points(tensors: PackedTensors, scheme: PackedScheme, rows: int, groups: int):
    """float32 [N, G]: the offset zero points (the midpoint when symmetric)."""
    if scheme.symmetric:
        return torch.full((rows, groups), float(2 ** (scheme.bits - 1)))
    if tensors.weight_zero_point is None:
        raise ValueError("an asymmetric compressed-tensors layer lacks weight_zero_point")
    words = (_words(rows, scheme.bits), groups)
    packed = _packed_words(tensors.weight_zero_point, "weight_zero_point", words)
    zeros = unpack_columns(packed.T.contiguous(), scheme.bits)[:, :rows].T.float()
    return zeros.contiguous()


def unpack_pack_quantized(tensors: PackedTensors, scheme: PackedScheme) -> UnpackedGPTQ:
    """The integers and scales of one layer (see the module docstring)."""
    rows, cols = layer_shape(tensors.weight_shape)
    group_size = cols if scheme.group_size == PER_CHANNEL else scheme.group_size
    if cols % group_size:
        raise ValueError(f"{cols} inputs are not groups of {group_size}")
    groups = cols // group_size
    words = (rows, _words(cols, scheme.bits))
    packed = _packed_words(tensors.weight_packed, "weight_packed", words)
    q = unpack_columns(packed, scheme.bits)[:, :cols]
    if tensors.weight_scale.shape != (rows, groups):
        raise ValueError(
            f"weight_scale {tuple(tensors.weight_scale.shape)} does not fit {rows} outputs x "
            f"{cols} inputs in groups of {group_size}"
        )
    order = input_order(tensors.weight_g_idx, cols, group_size)
    if order is not None:
        q = q[:, order]
    return UnpackedGPTQ(
        q.contiguous(), tensors.weight_scale.float().contiguous(),
        _zero_points(tensors, scheme, rows, groups), order, group_size, scheme.bits,
    )  # fmt: skip
