"""`quantization="compressed-tensors"` (int8 W8A8, FP8) and `"fp8"`: a checkpoint's 8-bit
linear layers kept 8-bit.

`keep_w8a8_weights` finds every layer the checkpoint stores quantized (a `weight` with a
`weight_scale` or `weight_scale_inv` beside it; layers a config ignores have none and load
as usual), replaces the model's `Linear` for it with its 8-bit layer (`w8a8_linear.py`;
fused q/k/v and gate/up from their parts, or from their rows of the one layer Phi-3's
checkpoints store, `whole_fused.py`) and each mixture's `GroupedExperts` by
`W8A8GroupedExperts` on its experts' 8-bit parts (`w8a8_experts.py`), before any weight is
read, and returns the tensor names it consumed, which the loader then skips. As for the
packed layers (`packed_swap.py`), a tensor-parallel rank keeps its rows of each layer
(`w8a8_parallel.py`) and a pipeline stage swaps in only its own layers.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.gguf_linear import GGUFConcatLinear, distinct_bytes
from pagedllm.model.layers.gguf_parallel import RowSlice
from pagedllm.model.layers.kernel_experts import ExpertPart
from pagedllm.model.layers.linear import Linear, MergedLinear
from pagedllm.model.layers.packed_swap import architecture_name, parts_by_module, replace_module
from pagedllm.model.layers.w8a8_experts import WeightsOf, w8a8_grouped_experts
from pagedllm.model.layers.w8a8_linear import w8a8_layer
from pagedllm.model.layers.w8a8_parallel import (
    parallel_w8a8_layer,
    rank_w8a8_weights,
    take_w8a8_rows,
)
from pagedllm.model.layers.w8a8_weights import W8A8Weights, can_stack, stack_weights
from pagedllm.model.layers.whole_fused import is_stored_whole, stored_shard_rows
from pagedllm.model.quantization.ct_w8a8 import w8a8_scheme
from pagedllm.model.quantization.fp8 import fp8_scheme
from pagedllm.model.quantization.w8a8_scheme import FP8, PER_GROUP, WEIGHT_BLOCK, W8A8Scheme

logger = logging.getLogger("pagedllm")

SCALE_NAMES = ("weight_scale", "weight_scale_inv")
TENSOR_NAMES = ("weight", *SCALE_NAMES, "input_scale", "weight_zero_point", "input_zero_point")
STORED_DTYPES = {FP8: torch.float8_e4m3fn}


def read_w8a8_tensors(directory: str) -> dict[str, dict[str, torch.Tensor]]:
    """Layer prefix -> its tensors (`TENSOR_NAMES`), for the layers stored quantized."""
    from safetensors import safe_open

    found: dict[str, dict[str, torch.Tensor]] = {}
    for file_name in sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")):
        with safe_open(os.path.join(directory, file_name), framework="pt") as checkpoint:
            names = list(checkpoint.keys())
            quantized = {n.rpartition(".")[0] for n in names if n.rpartition(".")[2] in SCALE_NAMES}
            for name in names:
                prefix, _, leaf = name.rpartition(".")
                if prefix in quantized and leaf in TENSOR_NAMES:
                    found.setdefault(prefix, {})[leaf] = checkpoint.get_tensor(name)
    return found


def layer_weights(prefix: str, tensors: dict[str, torch.Tensor], scheme: W8A8Scheme) -> W8A8Weights:
    """One layer's `W8A8Weights`, its tensors checked against the scheme."""
    values = tensors.get("weight")
    expected = STORED_DTYPES.get(scheme.weight_type, torch.int8)
    if values is None or values.dtype != expected or values.dim() != 2:
        got = None if values is None else f"{values.dtype} {tuple(values.shape)}"
        raise ValueError(f"{prefix}: expected a 2-D {expected} weight, found {got}")
    _check_activation_groups(prefix, values.shape[1], scheme)
    for zero_point in ("weight_zero_point", "input_zero_point"):
        if zero_point in tensors and bool(tensors[zero_point].any()):
            raise ValueError(f"{prefix}: nonzero {zero_point} (asymmetric) is not served")
    scale = tensors.get("weight_scale_inv", tensors.get("weight_scale")).to(torch.float32)
    input_scale = tensors.get("input_scale")
    if scheme.activations is not None and not scheme.activations.dynamic and input_scale is None:
        raise ValueError(f"{prefix}: static activations without an input_scale")
    if input_scale is not None:
        input_scale = input_scale.to(torch.float32).reshape(())
    return W8A8Weights(
        values, _layer_scales(prefix, scale, values.shape, scheme), scheme, input_scale
    )


def _check_activation_groups(prefix: str, cols: int, scheme: W8A8Scheme) -> None:
    """Activations scaled per group need whole groups: checked at load, not at the first
    forward (the engine's first request)."""
    activations = scheme.activations
    if activations is None or activations.strategy != PER_GROUP:
        return
    if cols % activations.group_size:
        raise ValueError(
            f"{prefix}: {cols} inputs are not whole activation groups of {activations.group_size}"
        )


def _layer_scales(
    prefix: str, scale: torch.Tensor, shape: torch.Size, scheme: W8A8Scheme
) -> torch.Tensor:
    rows, cols = shape
    if scheme.weight_strategy == WEIGHT_BLOCK:
        block_rows, block_cols = scheme.block
        blocks = (-(-rows // block_rows), -(-cols // block_cols))
        if tuple(scale.shape) != blocks:
            raise ValueError(f"{prefix}: block scales {tuple(scale.shape)}, expected {blocks}")
        return scale.contiguous()
    if scale.numel() == 1:  # per tensor: one scale, kept per row (fused parts differ)
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    if scale.numel() != rows:
        raise ValueError(f"{prefix}: {scale.numel()} weight scales for {rows} output channels")
    return scale.reshape(rows, 1).contiguous()


def checkpoint_scheme(method: str, config: dict[str, Any]) -> W8A8Scheme:
    """The 8-bit scheme of a checkpoint's `quantization_config` (the registry served it)."""
    return fp8_scheme(config) if method == "fp8" else w8a8_scheme(config)


def keep_w8a8_weights(model: nn.Module, directory: str, scheme: W8A8Scheme) -> set[str]:
    """Swap in the 8-bit layers (see the module docstring); returns the names they hold."""
    layers = read_w8a8_tensors(directory)
    parts, experts, elsewhere = parts_by_module(model, layers, "8-bit")
    # Another pipeline stage's layers: never swapped in here (that stage swaps its own).
    consumed = {f"{prefix}.{leaf}" for prefix in elsewhere for leaf in layers[prefix]}
    for name, module_parts in parts.items():
        weights = {
            shard: layer_weights(prefix, tensors, scheme)
            for shard, (prefix, tensors) in module_parts.items()
        }
        swap_in_w8a8(model, name, weights)
        consumed |= {f"{prefix}.{leaf}" for prefix, t in module_parts.values() for leaf in t}
    for name, expert_parts in experts.items():
        _swap_checkpoint_experts(model, name, expert_parts, scheme)
        consumed |= {f"{prefix}.{leaf}" for prefix, t in expert_parts.values() for leaf in t}
    log_w8a8_layers(model, [*parts, *experts], scheme, "checkpoint")
    return consumed


def _swap_checkpoint_experts(
    model: nn.Module,
    name: str,
    parts: dict[ExpertPart, tuple[str, dict[str, torch.Tensor]]],
    scheme: W8A8Scheme,
) -> None:
    def weights_of(part: ExpertPart) -> W8A8Weights:
        prefix, tensors = parts[part]
        return layer_weights(prefix, tensors, scheme)

    swap_in_w8a8_experts(model, name, set(parts), weights_of)


def swap_in_w8a8_experts(
    model: nn.Module, name: str, parts: set[ExpertPart], weights_of: WeightsOf
) -> None:
    """Replace the `GroupedExperts` at `name` with its experts on their 8-bit `parts` (all
    of them; `w8a8_experts.w8a8_grouped_experts`). Its stacked fp32 parameters were never
    written, so they never became resident."""
    layer = w8a8_grouped_experts(model.get_submodule(name), parts, weights_of, name)
    replace_module(model, name, layer)


def swap_in_w8a8(model: nn.Module, name: str, weights: dict[str | None, W8A8Weights]) -> None:
    """Replace the `Linear` `name` by its 8-bit layer from its parts' whole weights (this
    rank keeps its rows)."""
    module = model.get_submodule(name)
    where = f"{architecture_name(model)}'s {name!r}"
    replace_module(model, name, _w8a8_layer(where, module, weights))
    module._parameters.pop("weight", None)  # never loaded: its storage was never touched


def _stored_shards(
    where: str, module: Linear, parts: dict[str | None, W8A8Weights]
) -> dict[str | None, W8A8Weights]:
    """The parts as the fused layer's shards: a fused projection stored whole (Phi-3's,
    `whole_fused.py`) cut into its shards' rows, whose scales stay the rows' own (a block of
    rows a shard starts inside keeps its scales one row each, `take_w8a8_rows`)."""
    if not is_stored_whole(module, parts):
        return parts
    whole = parts[None]
    spans = stored_shard_rows(module, whole.out_features, f"the 8-bit layer {where}")
    return {
        shard: take_w8a8_rows(whole, RowSlice(span.start, len(span)))
        for shard, span in spans.items()
    }


def log_w8a8_layers(model: nn.Module, names: list[str], scheme: W8A8Scheme, origin: str) -> None:
    """`names`: the modules swapped in (a mixture's experts one module each)."""
    logger.info(
        "%s 8-bit layers (%s): %d modules (%.0f MB)",
        origin,
        scheme.describe(),
        len(names),
        sum(_held_bytes(model.get_submodule(n)) for n in names) / 1e6,
    )


def _held_bytes(module: nn.Module) -> int:
    """What a swapped-in module holds: its own count where it has one (fbgemm's prepacked
    int8 weights live outside the module's buffers), else its buffers'."""
    if hasattr(module, "weight_bytes"):
        return module.weight_bytes()
    return distinct_bytes(t for t in module.buffers() if t is not None)


def _w8a8_layer(where: str, module: Linear, parts: dict[str | None, W8A8Weights]) -> nn.Module:
    """The 8-bit layer replacing `module` from this rank's rows of its parts (all of them
    on one rank; `w8a8_parallel.py`); `where` names it in refusals."""
    parts = _stored_shards(where, module, parts)
    order = list(module.shard_slices) if isinstance(module, MergedLinear) else [None]
    if set(parts) != set(order):
        raise ValueError(
            f"the checkpoint quantizes {sorted(map(str, parts))} of {where}, whose parts are "
            f"{sorted(map(str, order))}: a fused layer needs all of them quantized"
        )
    mine = {shard: rank_w8a8_weights(module, shard, weights) for shard, weights in parts.items()}
    if not isinstance(module, MergedLinear):
        return parallel_w8a8_layer(module, mine[None])
    ordered = [mine[s] for s in order]
    if can_stack(ordered):
        layer = w8a8_layer(stack_weights(ordered), module.bias, module.output_sizes)
    else:
        layer = GGUFConcatLinear([w8a8_layer(p) for p in ordered], module.output_sizes, module.bias)
    layer.shard_slices = dict(module.shard_slices)  # LoRA adapters address its shards
    if hasattr(module, "shard_sources"):  # and cut them as the rank's rows were cut
        layer.shard_sources = dict(module.shard_sources)
    return layer
