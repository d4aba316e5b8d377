"""`quantization="compressed-tensors"`, format pack-quantized: the W4A16 / W8A16 layers of
an llm-compressor checkpoint kept 4- or 8-bit.

`keep_pack_quantized_weights` reads every layer holding a `weight_packed` (with its scale,
shape and, as the scheme has them, zero points and g_idx: this rank's output rows,
`layout`), finds its config group's scheme (`ct_pack_quantized.layer_scheme`), unpacks it
(`ct_pack_format.py`) and swaps in the layers (`packed_swap.py`); ignored layers load as
plain weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.packed_reads import LayerTensors, PackedLayout, index_layer_tensors
from pagedllm.model.layers.packed_swap import swap_packed_layers
from pagedllm.model.quantization.ct_pack_format import (
    REQUIRED,
    TENSOR_NAMES,
    PackedTensors,
    layer_shape,
    unpack_pack_quantized,
)
from pagedllm.model.quantization.ct_pack_quantized import layer_scheme
from pagedllm.model.quantization.gptq_format import UnpackedGPTQ


def layout(config: dict[str, Any]) -> PackedLayout:
    """Outputs along the rows of weight_packed and weight_scale; weight_zero_point packs
    32 / bits of them an int32 (the layer's group's bits). A symmetric layer's zero points
    are never used (the midpoint is), so a stored tensor of them, of whatever layout, is
    read whole and ignored on every rank as on one."""

    def axes(prefix: str) -> dict[str, tuple[int, int]]:
        scheme = layer_scheme(config, prefix)
        cut = {"weight_packed": (0, 1), "weight_scale": (0, 1)}
        return cut if scheme.symmetric else {**cut, "weight_zero_point": (0, 32 // scheme.bits)}

    return PackedLayout(rows=("weight_scale", 0), axes=axes, narrowed=_window_shape)


def _window_shape(tensors: LayerTensors, window: range, rows: int) -> LayerTensors:
    """weight_shape (N, K) of the layer read: the window's outputs, once N is seen to be
    the layer's."""
    outputs, inputs = layer_shape(tensors["weight_shape"])
    if outputs != rows:
        raise ValueError(f"weight_shape {(outputs, inputs)} does not fit {rows} output rows")
    return {**tensors, "weight_shape": torch.tensor([len(window), inputs])}


def keep_pack_quantized_weights(
    model: nn.Module, directory: str, config: dict[str, Any]
) -> set[str]:
    """Swap in the pack-quantized layers; returns the checkpoint names they hold."""

    def unpack(prefix: str, tensors: LayerTensors) -> UnpackedGPTQ:
        return unpack_pack_quantized(PackedTensors(**tensors), layer_scheme(config, prefix))

    layers = index_layer_tensors(directory, TENSOR_NAMES, REQUIRED, "compressed-tensors")
    method = "compressed-tensors pack-quantized"
    return swap_packed_layers(model, layers, unpack, method, layout(config))
