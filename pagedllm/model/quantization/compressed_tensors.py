"""compressed-tensors checkpoints (llm-compressor's `quant_method` "compressed-tensors"):
each config group's scheme named (weight and activation bits, strategy, group size) and the
checkpoint's `format` (pack-quantized, int-quantized, float-quantized, ...).

A group's format is its own `format`, else the checkpoint's. A checkpoint is served by one
family of layers: pack-quantized groups by the packed 4/8-bit layers, each group checked
on its own (`ct_pack_quantized.py`); the 8-bit formats (int-, float- and naive-quantized)
by the W8A8 / FP8 layers, every group one scheme (`ct_w8a8.py`). Other formats, and a
checkpoint mixing the two families, are refused by name.
"""

from __future__ import annotations

from typing import Any

from pagedllm.model.quantization import ct_pack_quantized, ct_w8a8
from pagedllm.model.quantization.method import CheckpointMethod

PACKED_FORMATS = frozenset({ct_pack_quantized.PACK_QUANTIZED})
EIGHT_BIT_FORMATS = frozenset(ct_w8a8.SERVED_FORMATS)


class CompressedTensorsMethod(CheckpointMethod):
    name = "compressed-tensors"
    served = f"compressed-tensors {ct_pack_quantized.SERVED}; {ct_w8a8.SERVED}"

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
        formats = {group_format(config, group) for group in groups.values()}
        if formats <= EIGHT_BIT_FORMATS:
            return ct_w8a8.refusal(config)
        unread = formats - PACKED_FORMATS - EIGHT_BIT_FORMATS
        if unread:
            return f"format {', '.join(map(repr, sorted(unread)))} is not read"
        if not formats <= PACKED_FORMATS:
            return f"formats {', '.join(map(repr, sorted(formats)))} are not served together"
        for name, group in groups.items():
            why = ct_pack_quantized.group_refusal(group)
            if why is not None:
                return f"config group {name!r}: {why}"
        return None


def is_pack_quantized(config: dict[str, Any]) -> bool:
    """Whether a served compressed-tensors checkpoint is read by the packed layers (else by
    the 8-bit ones)."""
    groups = (config.get("config_groups") or {}).values()
    return all(group_format(config, group) in PACKED_FORMATS for group in groups)


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
