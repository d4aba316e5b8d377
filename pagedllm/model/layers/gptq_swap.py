"""`quantization="gptq"`: a GPTQ checkpoint's linear layers kept 4-bit.

`keep_gptq_weights` reads every quantized layer's packed tensors (`qweight`, `qzeros`,
`scales`, `g_idx`), unpacks them (`gptq_format.py`) and swaps in the layers
(`packed_swap.py`); it returns the tensor names consumed, which the loader then skips.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.model.layers.packed_swap import LayerTensors, read_layer_tensors, swap_packed_layers
from pagedllm.model.quantization.gptq import GPTQConfig
from pagedllm.model.quantization.gptq_format import (
    TENSOR_NAMES,
    GPTQTensors,
    UnpackedGPTQ,
    unpack_gptq,
)


def keep_gptq_weights(model: nn.Module, directory: str, config: dict[str, Any]) -> set[str]:
    """Swap in the GPTQ layers; returns the checkpoint names they hold."""
    gptq = GPTQConfig.from_dict(config)

    def unpack(prefix: str, tensors: LayerTensors) -> UnpackedGPTQ:
        return unpack_gptq(GPTQTensors(**{n: tensors.get(n) for n in TENSOR_NAMES}), gptq)

    layers = read_layer_tensors(directory, TENSOR_NAMES, TENSOR_NAMES[:3], "GPTQ")
    return swap_packed_layers(model, layers, unpack, f"gptq ({gptq.describe()})")
