"""compressed-tensors checkpoints (llm-compressor's `quant_method` "compressed-tensors"):
each config group's scheme named (weight and activation bits, strategy, group size) and the
checkpoint's `format` (pack-quantized, int-quantized, float-quantized, ...).

A group's format is its own `format`, else the checkpoint's. `FORMAT_REFUSALS` maps each
format read to the check of one group's scheme (`ct_pack_quantized.py` for
pack-quantized); a format not listed is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.model.quantization import ct_pack_quantized
from pagedllm.model.quantization.method import CheckpointMethod

# format -> why a config group's scheme is not served in it (None when it is).
FORMAT_REFUSALS: dict[str, Callable[[dict[str, Any]], str | None]] = {
    ct_pack_quantized.PACK_QUANTIZED: ct_pack_quantized.group_refusal,
}


class CompressedTensorsMethod(CheckpointMethod):
    name = "compressed-tensors"
    served = f"compressed-tensors {ct_pack_quantized.SERVED}"

    def scheme(self, config: dict[str, Any]) -> str:
        groups = config.get("config_groups") or {}
        schemes = sorted({_group_scheme(group) for group in groups.values()}) or ["no groups"]
        return f"compressed-tensors {config.get('format', '?')} ({'; '.join(schemes)})"

    def refusal(self, config: dict[str, Any]) -> str | None:
        groups = config.get("config_groups") or {}
        if not groups:
            return "a compressed-tensors checkpoint without config_groups is not read"
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            return f"quantization_status {status!r} (weights not stored compressed) is not read"
        for what in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            if config.get(what):
                return f"compressed-tensors' {what} is not read"
        for name, group in groups.items():
            fmt = group_format(config, group)
            check = FORMAT_REFUSALS.get(fmt)
            why = f"format {fmt!r} is not read" if check is None else check(group)
            if why is not None:
                return f"config group {name!r}: {why}"
        return None


def group_format(config: dict[str, Any], group: dict[str, Any]) -> str:
    """A config group's format: its own, else the checkpoint's."""
    return str(group.get("format") or config.get("format"))


def _group_scheme(group: dict[str, Any]) -> str:
    """'W4A16 int group 128' style: weight bits, activation bits (16: not quantized)."""
    weights = group.get("weights") or {}
    activations = group.get("input_activations") or {}
    text = f"W{weights.get('num_bits', '?')}A{activations.get('num_bits', 16)}"
    text += f" {weights.get('type', 'int')} {weights.get('strategy', '?')}"
    if weights.get("group_size"):
        text += f" {weights['group_size']}"
    return text
