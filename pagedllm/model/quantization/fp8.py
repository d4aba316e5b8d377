"""FP8 checkpoints (`quant_method` "fp8"): detected and refused, naming the scheme."""

from __future__ import annotations

from typing import Any

from pagedllm.model.quantization.method import CheckpointMethod


class FP8Method(CheckpointMethod):
    name = "fp8"

    def scheme(self, config: dict[str, Any]) -> str:
        block = config.get("weight_block_size")
        weights = f"blocks {block}" if block else "per tensor"
        activations = config.get("activation_scheme", "dynamic")
        return f"fp8 {config.get('fmt', 'e4m3')} weights ({weights}), {activations} activations"
