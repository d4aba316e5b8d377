"""compressed-tensors checkpoints (llm-compressor's `quant_method` "compressed-tensors"):
the scheme named by each config group's weight and activation scheme and the checkpoint's
`format` (pack-quantized, int-quantized, float-quantized, ...). The 8-bit formats are
served (`ct_w8a8.py`); the others are refused by that name."""

from __future__ import annotations

from typing import Any

from pagedllm.model.quantization import ct_w8a8
from pagedllm.model.quantization.method import CheckpointMethod


class CompressedTensorsMethod(CheckpointMethod):
    name = "compressed-tensors"
    served = ct_w8a8.SERVED

    def scheme(self, config: dict[str, Any]) -> str:
        groups = config.get("config_groups") or {}
        schemes = sorted({_group_scheme(group) for group in groups.values()}) or ["no groups"]
        return f"compressed-tensors {config.get('format', '?')} ({'; '.join(schemes)})"

    def refusal(self, config: dict[str, Any]) -> str | None:
        return ct_w8a8.refusal(config)


def _group_scheme(group: dict[str, Any]) -> str:
    """'W4A16 int group 128' style: weight bits, activation bits (16: not quantized)."""
    weights = group.get("weights") or {}
    activations = group.get("input_activations") or {}
    text = f"W{weights.get('num_bits', '?')}A{activations.get('num_bits', 16)}"
    text += f" {weights.get('type', 'int')} {weights.get('strategy', '?')}"
    if weights.get("group_size"):
        text += f" {weights['group_size']}"
    return text
