"""`quantization="gguf"`: which of a model's layers compute on the GGUF file's blocks.

`keep_gguf_blocks` replaces every `Linear` whose tensors have a block kernel (Q4_0, Q4_1,
Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) with a layer on the file's own
blocks, and the token embedding with a `GGUFEmbedding` on them (a tied head and the
embedding share one copy), and returns the checkpoint names it consumed. The runner calls
it before any weight is read: the model's fp32 storage for those layers is allocated but
never written, so it never becomes resident, and the loader dequantizes only the rest
(norms, biases, types without a kernel). An 8B Q4_K_M model therefore loads in about its
file's size, not in fp32's 32 GB.
A fused projection whose parts have different types (Q4_K_M's q/k in Q4_K, v in Q6_K) gets
one kernel layer per run of types that share one (`kernel_type_of_run`: equal, or Q5_0
beside Q8_0, held as Q8_0), its outputs concatenated.
A mixture's experts (the file's stacked `ffn_*_exps` tensors) become `GGUFGroupedExperts`:
one kernel layer per expert and projection, on that expert's slice of the blocks.
With several tensor-parallel ranks each layer keeps only this rank's rows of the file's
blocks (`gguf_parallel`: whole rows, so its outputs are one rank's bit for bit).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from torch import nn

from pagedllm.model.layers.fused_moe import GroupedExperts
from pagedllm.model.layers.gguf_embedding import GGUFEmbedding
from pagedllm.model.layers.gguf_experts import gguf_grouped_experts
from pagedllm.model.layers.gguf_linear import (
    KERNEL_TYPES,
    GGUFConcatLinear,
    GGUFLinear,
    GGUFMergedLinear,
    distinct_bytes,
    kernel_runs,
)
from pagedllm.model.layers.gguf_parallel import gguf_embedding, parallel_gguf_layer, rank_rows
from pagedllm.model.layers.linear import Linear, MergedLinear

logger = logging.getLogger("pagedllm")

EMBEDDING = "model.embed_tokens"
# One shard of a module's weight in the file: (HF name, GGUF type, raw rows).
Shard = tuple[str, Any, np.ndarray]


def keep_gguf_blocks(model: nn.Module, path: str, activation_bits: int = 16) -> set[str]:
    """Swap in the GGUF layers (see the module docstring), their activations quantized to
    `activation_bits` (16: two int8 digits, 8: one); returns the HF names of the checkpoint
    tensors they hold, which the loader must not read again."""
    from pagedllm.ops.extension import load

    try:
        load()
    except RuntimeError as error:
        raise ValueError(f"quantization='gguf' needs the CPU kernels: {error}") from error
    shards = _gguf_shards(model, path)
    consumed: set[str] = set()
    replaced, kept = [], []
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]:
        layer = _gguf_layer(module, shards.get(name, {}))
        if layer is None:
            kept.append(name)
            continue
        _replace(model, name, layer)
        module._parameters.pop("weight", None)  # never loaded: its storage was never touched
        # Done with its blocks (un-permuted q/k rows are copies): only the embedding's stay.
        consumed |= {hf_name for hf_name, _, _ in shards.pop(name).values()}
        replaced.append(name)
    for name, hf_names in _swap_experts(model, path).items():
        consumed |= hf_names
        replaced.append(name)
    for module in model.modules():
        if isinstance(module, GGUFLinear):
            module.digits = activation_bits // 8
    embedding = _gguf_embedding(model, shards)
    if embedding is not None:
        _replace(model, EMBEDDING, embedding)
        consumed.add(f"{EMBEDDING}.weight")
        replaced.append(EMBEDDING)
    elif f"{EMBEDDING}.weight" in consumed:  # a tied head's blocks; the lookup reads fp32
        consumed.discard(f"{EMBEDDING}.weight")
    logger.info(
        "quantization=gguf: %d layers compute on their GGUF blocks (%.0f MB); %d kept fp32 (%s)",
        len(replaced),
        distinct_bytes(t for n in replaced for t in model.get_submodule(n).buffers()) / 1e6,
        len(kept),
        ", ".join(kept[:4]) or "none",
    )
    return consumed


def _swap_experts(model: nn.Module, path: str) -> dict[str, set[str]]:
    """Each mixture's experts whose stacked tensors all have a kernel type, swapped for
    `GGUFGroupedExperts` on their blocks: module name -> the HF names it consumed. With
    several tensor-parallel ranks the experts stay dequantized."""
    from pagedllm.model.gguf_loader import iter_gguf_raw_experts

    experts = {n: m for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
    if not experts or any(m.tp_size != 1 for m in experts.values()):
        return {}
    stacked: dict[str, dict[str, tuple]] = {}
    for hf_name, parts in iter_gguf_raw_experts(path, model.config, KERNEL_TYPES):
        module, _, param = hf_name.rpartition(".")
        stacked.setdefault(module, {})[param] = (hf_name, parts)
    swapped: dict[str, set[str]] = {}
    for name, module in experts.items():
        found = stacked.get(name, {})
        if set(found) != {"gate_up_proj", "down_proj"}:  # a part without kernel type
            continue
        layer = gguf_grouped_experts(module, found["gate_up_proj"][1], found["down_proj"][1])
        _replace(model, name, layer)
        swapped[name] = {hf_name for hf_name, _ in found.values()}
    return swapped


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, layer)


def _gguf_shards(model: nn.Module, path: str) -> dict[str, dict[str | None, Shard]]:
    """Module name -> {shard id (None unless fused): (HF name, GGUF type, raw rows)}."""
    from pagedllm.model.gguf_loader import iter_gguf_raw_weights
    from pagedllm.model.models.llama import fused_param_name

    tied = getattr(model, "tie_word_embeddings", False)
    shards: dict[str, dict[str | None, Shard]] = {}
    for hf_name, ggml_type, raw in iter_gguf_raw_weights(path, model.config, KERNEL_TYPES):
        param_name, shard_id = fused_param_name(hf_name)
        module = param_name.removesuffix(".weight")
        shards.setdefault(module, {})[shard_id] = (hf_name, ggml_type, raw)
        if tied and module == EMBEDDING:
            shards.setdefault("lm_head", {})[None] = (hf_name, ggml_type, raw)
    return shards


def _gguf_layer(module: Linear, parts: dict[str | None, Shard]) -> nn.Module | None:
    """The GGUF layer for `module` from its shards, if every shard has a kernel type."""
    order = list(module.shard_slices) if isinstance(module, MergedLinear) else [None]
    if set(parts) != set(order):  # a part of a type without kernel (never yielded)
        return None
    # all of a shard's rows on one rank
    runs = kernel_runs([(parts[s][1], rank_rows(module, s, parts[s][2])) for s in order])
    if len(runs) > 1:
        layers = [GGUFLinear(raws, ggml_type) for ggml_type, raws in runs]
        merged: nn.Module = GGUFConcatLinear(layers, module.output_sizes, module.bias)
    elif isinstance(module, MergedLinear):
        merged = GGUFMergedLinear(runs[0][1], runs[0][0], module.output_sizes, module.bias)
    else:
        return parallel_gguf_layer(module, runs[0][1], runs[0][0])
    merged.shard_slices = dict(module.shard_slices)  # LoRA adapters address its shards
    return merged


def _gguf_embedding(
    model: nn.Module, shards: dict[str, dict[str | None, Shard]]
) -> GGUFEmbedding | None:
    """The embedding on its blocks: the tied head's tables when the head has them."""
    embedding = _find(model, EMBEDDING)
    shard = shards.get(EMBEDDING, {}).get(None)
    if embedding is None or shard is None or shard[1] not in KERNEL_TYPES:
        return None
    _, ggml_type, raw = shard
    head = _find(model, "lm_head")
    if isinstance(head, GGUFLinear) and getattr(model, "tie_word_embeddings", False):
        source = head  # the same rows: the head's vocabulary shard is the embedding's
    else:
        source = GGUFLinear(rank_rows(embedding, None, raw), ggml_type)
    # Every name, duplicates too: a table stored under two (Q6_K's scale and min) stays one.
    tables = {n: t for n, t in source.named_buffers(remove_duplicate=False) if n != "bias"}
    return gguf_embedding(embedding, tables, ggml_type, source)


def _find(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
