"""The 8-bit schemes served (int8 W8A8, FP8): how a checkpoint's weights are scaled and how
activations are quantized before the matmul, in one form that both config readers fill
(`ct_w8a8.py` for compressed-tensors, `fp8.py` for `quant_method` "fp8").

Weights: int8 or float8_e4m3fn, one fp32 scale per output channel, per tensor, or per
block of [rows, cols] (the fp8 format's 128 x 128). Activations: quantized on every call to
the weights' type with a scale per token, per token and group of columns, per tensor, or a
static per-tensor scale from the checkpoint; or not at all (weight-only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INT8 = "int"
FP8 = "float"
WEIGHT_CHANNEL, WEIGHT_TENSOR, WEIGHT_BLOCK = "channel", "tensor", "block"
PER_TOKEN, PER_TENSOR, PER_GROUP = "token", "tensor", "group"


def positive_ints(values: Any, count: int) -> tuple[int, ...] | None:
    """`values` as `count` positive integers, or None when they are not: a config's block
    or group sizes divide the layer, so a zero, a negative or a string is refused up front."""
    if not isinstance(values, list | tuple) or len(values) != count:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    return tuple(values)


@dataclass(frozen=True)
class ActivationScheme:
    """How an activation row is quantized before the matmul."""

    strategy: str  # PER_TOKEN, PER_TENSOR or PER_GROUP
    dynamic: bool  # False: the checkpoint's `input_scale` (per tensor) is used
    group_size: int = 0  # PER_GROUP: columns per scale

    def describe(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        if self.strategy == PER_GROUP:
            return f"{kind} per token and group of {self.group_size}"
        return f"{kind} per {self.strategy}"


@dataclass(frozen=True)
class W8A8Scheme:
    """One quantized linear layer's format (see the module docstring)."""

    weight_type: str  # INT8 or FP8; activations are quantized to the same type
    weight_strategy: str  # WEIGHT_CHANNEL, WEIGHT_TENSOR or WEIGHT_BLOCK
    activations: ActivationScheme | None  # None: weight-only (activations stay fp32)
    block: tuple[int, int] | None = None  # WEIGHT_BLOCK: [output rows, input cols]

    def describe(self) -> str:
        bits = "int8" if self.weight_type == INT8 else "fp8 e4m3"
        weights = f"blocks {list(self.block)}" if self.block else f"per {self.weight_strategy}"
        acts = self.activations.describe() if self.activations else "not quantized"
        return f"{bits} weights {weights}, activations {acts}"
