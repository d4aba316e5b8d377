"""FP8 checkpoints (`quant_method` "fp8", as Transformers' and vLLM's `Fp8Config` write them):
which are served.

Per quantized layer: `weight` float8_e4m3fn [N, K] and either `weight_scale_inv` fp32
[ceil(N / bn), ceil(K / bk)] for `weight_block_size` [bn, bk] (the dequantization
multiplier, despite its name) or a per-tensor `weight_scale`; with `activation_scheme`
"static" also `input_scale`. Activations are fp8 too: dynamic per token and group of bk
inputs with blocks, dynamic per tensor without, or the static scale. Served: e4m3 weights,
blocks or per tensor, either activation scheme (static only per tensor). Refused by name:
e5m2 and static activations with blocks.
"""

from __future__ import annotations

from typing import Any

from pagedllm.model.quantization.method import CheckpointMethod
from pagedllm.model.quantization.w8a8_scheme import (
    FP8,
    PER_GROUP,
    PER_TENSOR,
    WEIGHT_BLOCK,
    WEIGHT_TENSOR,
    ActivationScheme,
    W8A8Scheme,
    positive_ints,
)


def fp8_scheme(config: dict[str, Any]) -> W8A8Scheme:
    """The scheme of an `Fp8Config` (check `FP8Method.refusal` first)."""
    block = config.get("weight_block_size")
    dynamic = config.get("activation_scheme", "dynamic") == "dynamic"
    if block:
        rows, cols = (int(n) for n in block)
        activations = ActivationScheme(PER_GROUP, True, cols)
        return W8A8Scheme(FP8, WEIGHT_BLOCK, activations, (rows, cols))
    return W8A8Scheme(FP8, WEIGHT_TENSOR, ActivationScheme(PER_TENSOR, dynamic))


class FP8Method(CheckpointMethod):
    name = "fp8"
    served = (
        "fp8 e4m3 weights in blocks (weight_block_size) or per tensor, activations dynamic "
        "(per token and group with blocks, per tensor without) or static per tensor"
    )

    def scheme(self, config: dict[str, Any]) -> str:
        block = config.get("weight_block_size")
        weights = f"blocks {block}" if block else "per tensor"
        activations = config.get("activation_scheme", "dynamic")
        return f"fp8 {config.get('fmt', 'e4m3')} weights ({weights}), {activations} activations"

    def refusal(self, config: dict[str, Any]) -> str | None:
        if config.get("fmt", "e4m3") != "e4m3":
            return f"fp8 {config.get('fmt')} weights have no reader (e4m3 only)"
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            return f"activation_scheme {scheme!r} is not dynamic or static"
        block = config.get("weight_block_size")
        if block and positive_ints(block, 2) is None:
            return f"weight_block_size {block} is not two positive integers [rows, columns]"
        if block and scheme == "static":
            return "static activation scales with block-quantized weights are not served"
        return None
