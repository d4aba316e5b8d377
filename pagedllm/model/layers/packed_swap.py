"""A checkpoint's packed integer layers (GPTQ, AWQ, compressed-tensors pack-quantized)
swapped in before the loader reads any weight.

`packed_reads.index_layer_tensors` finds each quantized layer's tensors (by their leaf
names) in the checkpoint's safetensors files without reading them; `swap_packed_layers`
then reads, layer by layer, only the output rows this rank keeps (`packed_reads.read_layer`,
`packed_parallel.py` says which), unpacks them with the format's `unpack`, replaces the
model's `Linear` for each with a `GPTQLinear` on the integers (fused q/k/v and gate/up from
their separately quantized parts, or from their rows of the one layer Phi-3's checkpoints
store, `whole_fused.py`), and each mixture's `GroupedExperts` with
`PackedGroupedExperts` on its experts' packed parts (read whole: each rank cuts its experts'
rows and groups after unpacking, `packed_experts.py`), and returns the tensor names it
consumed, which the loader then skips. The replaced layers' fp32 storage is never written
and never becomes resident; the loader fills the rest (embedding, norms, head, routers,
biases, layers left unquantized) as for an unquantized checkpoint. Each format's
`keep_*_weights` (gptq_swap, awq_swap, ct_pack_swap) gives its layout and unpacking; this
module does the rest. A pipeline stage swaps in only its own layers and names the others'
tensors as consumed, never reading them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import NamedTuple

from torch import nn

from pagedllm.model.layers.fused_moe import GroupedExperts
from pagedllm.model.layers.gguf_linear import distinct_bytes
from pagedllm.model.layers.gguf_parallel import RowSlice, rank_row_slice
from pagedllm.model.layers.gptq_linear import merged_gptq_layer
from pagedllm.model.layers.linear import Linear, MergedLinear
from pagedllm.model.layers.packed_experts import ExpertPart, UnpackPart, packed_grouped_experts
from pagedllm.model.layers.packed_parallel import (
    parallel_packed_layer,
    rank_weights,
    take_output_rows,
)
from pagedllm.model.layers.packed_reads import (
    LayerSource,
    LayerTensors,
    PackedLayout,
    output_rows,
    read_layer,
    word_window,
)
from pagedllm.model.layers.vocab_parallel import ParallelLMHead
from pagedllm.model.layers.whole_fused import is_stored_whole, stored_shard_rows
from pagedllm.model.quantization.gptq_format import UnpackedGPTQ

logger = logging.getLogger("pagedllm")

# (checkpoint prefix, its tensors) -> the layer's integers and scales
Unpack = Callable[[str, LayerTensors], UnpackedGPTQ]


def swap_packed_layers(
    model: nn.Module,
    layers: dict[str, LayerSource],
    unpack: Unpack,
    method: str,
    layout: PackedLayout,
) -> set[str]:
    """Swap in the layers (see the module docstring); returns the checkpoint names they
    hold. `method` names the format in messages."""
    require_kernels(method)
    parts, experts, elsewhere = parts_by_module(model, layers, method)
    # Another pipeline stage's layers: never read here (that stage swaps its own).
    consumed = {f"{prefix}.{leaf}" for prefix in elsewhere for leaf in layers[prefix]}
    for name, module_parts in parts.items():
        module = model.get_submodule(name)
        mine = {
            shard: _rank_part(module, shard, stored, (unpack, layout), method)
            for shard, stored in _stored_shards(module, module_parts, layout, method).items()
        }
        swap_in(model, name, mine, method, rows_taken=True)
        consumed |= _names(module_parts.values())
    for name, expert_parts in experts.items():
        _swap_experts(model, name, expert_parts, (unpack, layout), method)
        consumed |= _names(expert_parts.values())
    log_swapped(model, [*parts, *experts], method)
    return consumed


def _names(parts: Iterable[tuple[str, LayerSource]]) -> set[str]:
    """The checkpoint names of the parts' tensors."""
    return {f"{prefix}.{leaf}" for prefix, tensors in parts for leaf in tensors}


def _swap_experts(
    model: nn.Module,
    name: str,
    parts: dict[ExpertPart, tuple[str, LayerSource]],
    reading: tuple[Unpack, PackedLayout],
    method: str,
) -> None:
    unpack, layout = reading

    def unpack_part(part: ExpertPart) -> UnpackedGPTQ:
        prefix, source = parts[part]
        try:
            whole = range(output_rows(source, layout))
            return unpack(prefix, read_layer(source, layout, prefix, whole))
        except ValueError as error:
            raise ValueError(f"{method} layer {prefix!r}: {error}") from error

    swap_in_experts(model, name, set(parts), unpack_part)


def swap_in_experts(
    model: nn.Module, name: str, parts: set[ExpertPart], unpack_part: UnpackPart
) -> None:
    """Replace the `GroupedExperts` at `name` with its experts on their packed `parts`
    (all of them; `packed_experts.packed_grouped_experts`). Its stacked fp32 parameters were
    never written, so they never became resident."""
    layer = packed_grouped_experts(model.get_submodule(name), parts, unpack_part, name)
    replace_module(model, name, layer)


class StoredShard(NamedTuple):
    """Where one shard of a layer lies in the checkpoint: the stored layer's prefix and
    tensors, and its output rows there (None: all of them, a layer or part of its own)."""

    prefix: str
    source: LayerSource
    rows: range | None = None


def _stored_shards(
    module: nn.Module,
    module_parts: dict[str | None, tuple[str, LayerSource]],
    layout: PackedLayout,
    method: str,
) -> dict[str | None, StoredShard]:
    """Each shard of `module` where the checkpoint holds it: a separately quantized part,
    or its rows of a fused projection stored whole (Phi-3's, `whole_fused.py`)."""
    if not is_stored_whole(module, module_parts):
        return {shard: StoredShard(*part) for shard, part in module_parts.items()}
    prefix, source = module_parts[None]
    try:
        spans = stored_shard_rows(module, output_rows(source, layout), "the stored layer")
    except ValueError as error:
        raise ValueError(f"{method} layer {prefix!r}: {error}") from error
    return {shard: StoredShard(prefix, source, span) for shard, span in spans.items()}


def _rank_part(
    module: nn.Module,
    shard: str | None,
    stored: StoredShard,
    reading: tuple[Unpack, PackedLayout],
    method: str,
) -> UnpackedGPTQ:
    """This rank's rows of one layer (or fused shard), read as a window of whole words and
    cut after unpacking (`packed_reads`); a malformed layer refused with its name."""
    unpack, layout = reading
    prefix, source = stored.prefix, stored.source
    try:
        rows = output_rows(source, layout)
        span = range(rows) if stored.rows is None else stored.rows
        keep = rank_row_slice(module, shard, len(span))
        # A rank of padding rows only reads one word.
        start = span.start + (keep.start if keep.rows else 0)
        window = word_window(start, start + max(keep.rows, 1), rows)
        weights = unpack(prefix, read_layer(source, layout, prefix, window))
    except ValueError as error:
        raise ValueError(f"{method} layer {prefix!r}: {error}") from error
    if window == range(start, start + keep.rows) and not keep.padding:
        return weights
    return take_output_rows(weights, RowSlice(start - window.start, keep.rows, keep.padding))


def require_kernels(method: str) -> None:
    """The CPU kernels the packed layers run on, built or loaded; refused by name without."""
    from pagedllm.ops.extension import load

    try:
        load()
    except RuntimeError as error:
        raise ValueError(f"quantization={method!r} needs the CPU kernels: {error}") from error


def swap_in(
    model: nn.Module,
    name: str,
    parts: dict[str | None, UnpackedGPTQ],
    method: str,
    rows_taken: bool = False,
) -> None:
    """Replace the `Linear` at `name` with the packed layer on its parts' weights: whole,
    as the checkpoint holds them, of which this rank keeps its rows; or, `rows_taken`,
    this rank's rows already."""
    module = model.get_submodule(name)
    where = f"{architecture_name(model)}'s {name!r}"
    replace_module(model, name, _packed_layer(where, module, parts, method, rows_taken))
    module._parameters.pop("weight", None)  # never loaded: its storage was never touched


def log_swapped(model: nn.Module, names: list[str], method: str) -> None:
    logger.info(
        "quantization=%s: %d layers on packed integer weights (%.0f MB)",
        method,
        len(names),
        distinct_bytes(t for n in names for t in model.get_submodule(n).buffers()) / 1e6,
    )


def parts_by_module(
    model: nn.Module, layers: dict[str, LayerSource], method: str
) -> tuple[
    dict[str, dict[str | None, tuple[str, LayerSource]]],
    dict[str, dict[ExpertPart, tuple[str, LayerSource]]],
    list[str],
]:
    """Model module name -> {shard id (None unless fused): (checkpoint prefix, tensors)};
    a mixture's experts module name -> {(expert, shard): (checkpoint prefix, tensors)};
    and the checkpoint prefixes of layers another pipeline stage holds. Shared by every
    checkpoint format swapped in before loading (`w8a8_swap` too)."""
    target = model.checkpoint_target
    on_other_stage = getattr(model, "on_other_stage", lambda name: False)
    parts: dict[str, dict[str | None, tuple[str, LayerSource]]] = {}
    experts: dict[str, dict[ExpertPart, tuple[str, LayerSource]]] = {}
    elsewhere: list[str] = []
    for prefix, tensors in layers.items():
        param_name, shard_id = target(f"{prefix}.weight")
        if on_other_stage(param_name):
            elsewhere.append(prefix)
            continue
        experts_name = param_name.rpartition(".")[0]
        if isinstance(shard_id, tuple) and isinstance(_find(model, experts_name), GroupedExperts):
            experts.setdefault(experts_name, {})[shard_id] = (prefix, tensors)
            continue
        module_name = param_name.removesuffix(".weight")
        module = _find(model, module_name)
        if not isinstance(module, Linear) or _is_head(module_name, module):
            raise ValueError(
                f"{method} layer {prefix!r} has no linear layer to run on in pagedllm's "
                f"{architecture_name(model)} (quantized embeddings, MoE routers and heads are "
                "not served yet)"
            )
        parts.setdefault(module_name, {})[shard_id] = (prefix, tensors)
    return parts, experts, elsewhere


def architecture_name(model: nn.Module) -> str:
    """The checkpoint's architecture (MistralForCausalLM, not the Llama class serving it),
    for refusals."""
    architectures = getattr(getattr(model, "config", None), "architectures", None)
    return architectures[0] if architectures else type(model).__name__


def _find(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _is_head(module_name: str, module: nn.Module) -> bool:
    """The head is a `Linear` too, but a packed one would skip the ranks' logit gather."""
    return isinstance(module, ParallelLMHead) or module_name.rpartition(".")[2] == "lm_head"


def _packed_layer(
    where: str,
    module: Linear,
    parts: dict[str | None, UnpackedGPTQ],
    method: str,
    rows_taken: bool = False,
) -> nn.Module:
    """`where` names the layer (its architecture and module) in refusals."""
    order = list(module.shard_slices) if isinstance(module, MergedLinear) else [None]
    if set(parts) != set(order):
        raise ValueError(
            f"{method} checkpoint quantizes {sorted(map(str, parts))} of {where}, whose parts "
            f"are {sorted(map(str, order))}: a fused layer needs all of them quantized"
        )
    mine = parts if rows_taken else {s: rank_weights(module, s, w) for s, w in parts.items()}
    if not isinstance(module, MergedLinear):
        return parallel_packed_layer(module, mine[None])
    layer = merged_gptq_layer([mine[s] for s in order], module.output_sizes, module.bias)
    layer.shard_slices = dict(module.shard_slices)  # LoRA adapters address its shards
    if hasattr(module, "shard_sources"):  # and cut them as the rank's rows were cut
        layer.shard_sources = dict(module.shard_sources)
    return layer


def replace_module(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, layer)
