"""`quantization="gptq"`: a GPTQ checkpoint's linear layers kept 4-bit.

`keep_gptq_weights` reads every quantized layer's packed tensors (`qweight`, `qzeros`,
`scales`, `g_idx`: this rank's output columns of the first three, `LAYOUT`), unpacks them
(`gptq_format.py`) and swaps in the layers (`packed_swap.py`); it returns the tensor names
consumed, which the loader then skips.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.model.layers.packed_reads import LayerTensors, PackedLayout, index_layer_tensors
from pagedllm.model.layers.packed_swap import swap_packed_layers
from pagedllm.model.quantization.gptq import GPTQConfig
from pagedllm.model.quantization.gptq_format import (
    TENSOR_NAMES,
    GPTQTensors,
    UnpackedGPTQ,
    unpack_gptq,
)

# Outputs along qweight's and scales' columns; qzeros packs 8 of them an int32.
LAYOUT = PackedLayout(
    rows=("scales", 1), axes=lambda prefix: {"qweight": (1, 1), "qzeros": (1, 8), "scales": (1, 1)}
)


def keep_gptq_weights(model: nn.Module, directory: str, config: dict[str, Any]) -> set[str]:
    """Swap in the GPTQ layers; returns the checkpoint names they hold."""
    gptq = GPTQConfig.from_dict(config)

    def unpack(prefix: str, tensors: LayerTensors) -> UnpackedGPTQ:
        return unpack_gptq(GPTQTensors(**{n: tensors.get(n) for n in TENSOR_NAMES}), gptq)

    layers = index_layer_tensors(directory, TENSOR_NAMES, TENSOR_NAMES[:3], "GPTQ")
    return swap_packed_layers(model, layers, unpack, f"gptq ({gptq.describe()})", LAYOUT)
