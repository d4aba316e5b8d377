"""`quantization="compressed-tensors"`, format pack-quantized: the W4A16 / W8A16 layers of
an llm-compressor checkpoint kept 4- or 8-bit.

`keep_pack_quantized_weights` reads every layer holding a `weight_packed` (with its scale,
shape and, as the scheme has them, zero points and g_idx), finds its config group's
scheme (`ct_pack_quantized.layer_scheme`), unpacks it (`ct_pack_format.py`) and swaps in
the layers (`packed_swap.py`); ignored layers load as plain weights.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.model.layers.packed_swap import LayerTensors, read_layer_tensors, swap_packed_layers
from pagedllm.model.quantization.ct_pack_format import (
    REQUIRED,
    TENSOR_NAMES,
    PackedTensors,
    unpack_pack_quantized,
)
from pagedllm.model.quantization.ct_pack_quantized import layer_scheme
from pagedllm.model.quantization.gptq_format import UnpackedGPTQ


def keep_pack_quantized_weights(
    model: nn.Module, directory: str, config: dict[str, Any]
) -> set[str]:
    """Swap in the pack-quantized layers; returns the checkpoint names they hold."""

    def unpack(prefix: str, tensors: LayerTensors) -> UnpackedGPTQ:
        return unpack_pack_quantized(PackedTensors(**tensors), layer_scheme(config, prefix))

    layers = read_layer_tensors(directory, TENSOR_NAMES, REQUIRED, "compressed-tensors")
    return swap_packed_layers(model, layers, unpack, "compressed-tensors pack-quantized")
