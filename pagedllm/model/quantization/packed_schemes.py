"""Which projections a packed checkpoint's config quantizes, and how (bits, group size,
symmetry, act-order), read from its config alone: what `model/layers/packed_dummy.py`
makes random weights for under `load_format="dummy"`, so a config.json is a model of the
layers and bytes a checkpoint of that config would hold.

- GPTQ: every projection, one scheme;
- AWQ: every projection but those `modules_to_not_convert` names (a substring of the
  layer's name, as AutoAWQ matches them), 4-bit with zero points, no act-order;
- compressed-tensors pack-quantized: every projection a config group targets and `ignore`
  does not name (matched as `ct_pack_quantized` matches targets), with its group's scheme;
  act-order where the group's `actorder` is "group" (its layers store a `weight_g_idx`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.model.quantization import ct_pack_quantized
from pagedllm.model.quantization.awq import AWQConfig
from pagedllm.model.quantization.gptq import GPTQConfig


@dataclass(frozen=True)
class PackedLayerScheme:
    """How one layer's weights are stored packed."""

    bits: int
    group_size: int  # input rows per scale; -1: one scale per output channel
    sym: bool  # every zero point the midpoint
    desc_act: bool  # act-order: its input rows in groups out of order


# A layer's checkpoint name (without `.weight`) -> its scheme; None: stored unquantized.
LayerSchemes = Callable[[str], PackedLayerScheme | None]


def gptq_schemes(config: dict[str, Any]) -> LayerSchemes:
    gptq = GPTQConfig.from_dict(config)
    scheme = PackedLayerScheme(gptq.bits, gptq.group_size, gptq.sym, gptq.desc_act)
    return lambda layer: scheme


def awq_schemes(config: dict[str, Any]) -> LayerSchemes:
    awq = AWQConfig.from_dict(config)
    scheme = PackedLayerScheme(awq.bits, awq.group_size, sym=False, desc_act=False)
    not_converted = tuple(config.get("modules_to_not_convert") or ())
    return lambda layer: None if any(m in layer for m in not_converted) else scheme


def pack_quantized_schemes(config: dict[str, Any]) -> LayerSchemes:
    def scheme(layer: str) -> PackedLayerScheme | None:
        if not ct_pack_quantized.is_quantized_layer(config, layer):
            return None
        packed = ct_pack_quantized.layer_scheme(config, layer)
        actorder = ct_pack_quantized.has_group_actorder(config, layer)
        return PackedLayerScheme(packed.bits, packed.group_size, packed.symmetric, actorder)

    return scheme


SCHEMES: dict[str, Callable[[dict[str, Any]], LayerSchemes]] = {
    "gptq": gptq_schemes,
    "awq": awq_schemes,
    "compressed-tensors": pack_quantized_schemes,
}


def layer_schemes(method: str, config: dict[str, Any]) -> LayerSchemes:
    """The layer schemes of a served packed checkpoint config of `method`."""
    if method not in SCHEMES:
        raise ValueError(f"random packed weights are not made for quantization={method!r}")
    return SCHEMES[method](config)
