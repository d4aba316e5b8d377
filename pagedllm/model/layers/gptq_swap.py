"""`quantization="gptq"`: a GPTQ checkpoint's linear layers kept 4-bit.

`keep_gptq_weights` reads every quantized layer's packed tensors (`qweight`, `qzeros`,
`scales`, `g_idx`) from the checkpoint's safetensors files, replaces the model's `Linear`
for it with a `GPTQLinear` (fused q/k/v and gate/up from their separately quantized
parts), and returns the tensor names it consumed, which the loader then skips. The
runner calls it before any weight is read, so the replaced layers' fp32 storage is never
written and never becomes resident; the loader fills the rest (embedding, norms, head,
biases) as for an unquantized checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from torch import nn

from pagedllm.model.layers.gguf_linear import distinct_bytes
from pagedllm.model.layers.gptq_linear import GPTQLinear, merged_gptq_layer
from pagedllm.model.layers.linear import Linear, MergedLinear
from pagedllm.model.quantization.gptq import GPTQConfig
from pagedllm.model.quantization.gptq_format import (
    TENSOR_NAMES,
    GPTQTensors,
    UnpackedGPTQ,
    unpack_gptq,
)

logger = logging.getLogger("pagedllm")

QWEIGHT_SUFFIX = ".qweight"


def read_gptq_tensors(directory: str) -> dict[str, GPTQTensors]:
    """Layer prefix (HF name without `.qweight`) -> its packed tensors, from every
    safetensors file of `directory`."""
    from safetensors import safe_open

    found: dict[str, dict[str, Any]] = {}
    for file_name in sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")):
        with safe_open(os.path.join(directory, file_name), framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
                prefix, _, suffix = name.rpartition(".")
                if suffix in TENSOR_NAMES:
                    found.setdefault(prefix, {})[suffix] = checkpoint.get_tensor(name)
    layers = {}
    for prefix, tensors in found.items():
        missing = [n for n in TENSOR_NAMES[:3] if n not in tensors]
        if missing:
            raise ValueError(f"GPTQ layer {prefix!r} lacks {', '.join(missing)}")
        layers[prefix] = GPTQTensors(**{n: tensors.get(n) for n in TENSOR_NAMES})
    return layers


def keep_gptq_weights(model: nn.Module, directory: str, config: dict[str, Any]) -> set[str]:
    """Swap in the GPTQ layers (see the module docstring); returns the checkpoint names
    they hold."""
    from pagedllm.ops.extension import load

    try:
        load()
    except RuntimeError as error:
        raise ValueError(f"quantization='gptq' needs the CPU kernels: {error}") from error
    gptq = GPTQConfig.from_dict(config)
    parts = _parts_by_module(model, read_gptq_tensors(directory))
    consumed: set[str] = set()
    for name, module_parts in parts.items():
        module = model.get_submodule(name)
        unpacked = {shard: unpack_gptq(t, gptq) for shard, (_, t) in module_parts.items()}
        layer = _gptq_layer(name, module, unpacked)
        _replace(model, name, layer)
        module._parameters.pop("weight", None)  # never loaded: its storage was never touched
        consumed |= {f"{prefix}.{n}" for prefix, _ in module_parts.values() for n in TENSOR_NAMES}
    logger.info(
        "quantization=gptq (%s): %d layers on 4-bit weights (%.0f MB)",
        gptq.describe(),
        len(parts),
        distinct_bytes(t for n in parts for t in model.get_submodule(n).buffers()) / 1e6,
    )
    return consumed


def _parts_by_module(
    model: nn.Module, layers: dict[str, GPTQTensors]
) -> dict[str, dict[str | None, tuple[str, GPTQTensors]]]:
    """Model module name -> {shard id (None unless fused): (checkpoint prefix, tensors)}."""
    target = model.checkpoint_target
    parts: dict[str, dict[str | None, tuple[str, GPTQTensors]]] = {}
    for prefix, tensors in layers.items():
        param_name, shard_id = target(f"{prefix}.weight")
        module_name = param_name.removesuffix(".weight")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            module = None
        if not isinstance(module, Linear):
            raise ValueError(
                f"GPTQ layer {prefix!r} has no linear layer to run on in pagedllm's "
                f"{type(model).__name__} (quantized MoE experts and heads are not served yet)"
            )
        parts.setdefault(module_name, {})[shard_id] = (prefix, tensors)
    return parts


def _gptq_layer(name: str, module: Linear, parts: dict[str | None, UnpackedGPTQ]) -> nn.Module:
    order = list(module.shard_slices) if isinstance(module, MergedLinear) else [None]
    if set(parts) != set(order):
        raise ValueError(
            f"GPTQ checkpoint quantizes {sorted(map(str, parts))} of {name!r}, whose parts "
            f"are {sorted(map(str, order))}: a fused layer needs all of them quantized"
        )
    if not isinstance(module, MergedLinear):
        return GPTQLinear(parts[None], module.bias)
    layer = merged_gptq_layer([parts[s] for s in order], module.output_sizes, module.bias)
    layer.shard_slices = dict(module.shard_slices)
    return layer


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, layer)
