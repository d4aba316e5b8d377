"""`quantization="awq"`: an AutoAWQ checkpoint's linear layers kept 4-bit.

`keep_awq_weights` reads every quantized layer's GEMM-packed tensors (`qweight`, `qzeros`,
`scales`: this rank's output columns, `LAYOUT`), unpacks them (`awq_format.py`) and swaps
in the layers (`packed_swap.py`); layers AWQ left unquantized (`modules_to_not_convert`,
the head) load as plain weights.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.model.layers.packed_reads import LayerTensors, PackedLayout, index_layer_tensors
from pagedllm.model.layers.packed_swap import swap_packed_layers
from pagedllm.model.quantization.awq import AWQConfig
from pagedllm.model.quantization.awq_format import TENSOR_NAMES, AWQTensors, unpack_awq
from pagedllm.model.quantization.gptq_format import UnpackedGPTQ

# Outputs along scales' columns; qweight and qzeros pack 8 of them an int32 (interleaved
# within the word, which a window of whole words keeps).
LAYOUT = PackedLayout(
    rows=("scales", 1), axes=lambda prefix: {"qweight": (1, 8), "qzeros": (1, 8), "scales": (1, 1)}
)


def keep_awq_weights(model: nn.Module, directory: str, config: dict[str, Any]) -> set[str]:
    """Swap in the AWQ layers; returns the checkpoint names they hold."""
    awq = AWQConfig.from_dict(config)

    def unpack(prefix: str, tensors: LayerTensors) -> UnpackedGPTQ:
        return unpack_awq(AWQTensors(**tensors), awq)

    layers = index_layer_tensors(directory, TENSOR_NAMES, TENSOR_NAMES, "AWQ")
    return swap_packed_layers(model, layers, unpack, f"awq ({awq.describe()})", LAYOUT)
