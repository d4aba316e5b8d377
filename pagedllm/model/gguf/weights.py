"""A GGUF file's weights as the Hugging Face model holds them, dequantized or raw.

This module owns turning the file's tensors into the model's parameters: dequantized to
float32 one at a time (`iter_gguf_weights`, with an on-disk cache of the result for large
files) or left in their blocks for layers that compute on them (`iter_gguf_raw_weights`,
and `iter_gguf_raw_experts` for a mixture's stacked experts);
undoing what llama.cpp's converter did to their values (q/k rows permuted for Llama and
Mistral, Gemma 3's norm weights stored plus one); stacking a mixture's gate and up experts
in one tensor; and splitting Phi-3's fused q/k/v and gate/up tensors into the projections
they hold where a layer keeps the file's blocks.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedConfig

from pagedllm.model.gguf.cache import cache_dir_for, save_atomically
from pagedllm.model.gguf.config import load_gguf_config
from pagedllm.model.gguf.reader import dequantize_tensor, hf_shape
from pagedllm.model.gguf.tensor_names import PlanEntry, model_tensor_names, plan_tensors
from pagedllm.model.gguf.tensor_table import GGUFTensor, read_gguf_tensors

# Bump when the conversion changes, so cached weights are rebuilt.
_WEIGHTS_CACHE_VERSION = "1"
# Small files load fast anyway; caching their weights would only fill the disk.
_MIN_WEIGHTS_CACHE_BYTES = 32 * 1024 * 1024

# llama.cpp's HF->GGUF converter interleaves the rotary halves of q/k rows for
# these architectures (to match its GPT-J style rope); Qwen2 is stored as is.
_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})

# Architectures whose RMSNorm weight is an offset from one (`x * (1 + w)`): llama.cpp's
# converter stores w + 1, and the loader subtracts the one again in float32, as
# Transformers' GGUF loader does.
_NORM_OFFSET_ARCHITECTURES = frozenset({"gemma3"})

# Fused projection -> (projection, rows) in row order (Phi-3's q/k/v and gate/up).
FusedRows = dict[str, list[tuple[str, int]]]


def _unpermute(weight: torch.Tensor, n_head: int, name: str) -> torch.Tensor:
    """Invert llama.cpp's ``LlamaModel.permute`` on the rows of a q/k weight or bias."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{name}: {rows} rows do not split into {n_head} rotary heads")
    # The converter reshaped rows to (head, 2, half) and swapped the last two
    # axes; stored rows are therefore (head, half, 2).
    split = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape).contiguous()


def _dequantize_parts(parts: tuple[GGUFTensor, ...], path: str) -> torch.Tensor:
    """One tensor, or its parts stacked along dim 1 (each expert's gate rows, then its up
    rows), filled one part at a time so that only one part is ever held twice."""
    if len(parts) == 1:
        return dequantize_tensor(parts[0], path)
    shapes = [hf_shape(part) for part in parts]
    out = torch.empty(shapes[0][0], sum(shape[1] for shape in shapes), *shapes[0][2:])
    start = 0
    for part, shape in zip(parts, shapes, strict=True):
        out[:, start : start + shape[1]] = dequantize_tensor(part, path)
        start += shape[1]
    return out


def iter_gguf_weights(
    path: str, config: PreTrainedConfig | None = None, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every parameter stored in GGUF file ``path``.

    Tensors are dequantized one at a time (nothing is retained between yields),
    shaped and named as in the Hugging Face checkpoint, and for Llama/Mistral
    files q_proj/k_proj rows are un-permuted with ``config.num_attention_heads`` /
    ``config.num_key_value_heads``. ``config`` defaults to ``load_gguf_config(path)``.
    ``lm_head.weight`` is only yielded when the file stores it (untied models).
    The file is validated (format, tensor names, tensor types) before this returns.
    Tensors named in ``skip`` (layers that keep the file's blocks) are neither dequantized
    nor yielded; so are Phi-3's fused tensors all of whose projections ``skip`` names (see
    `iter_gguf_raw_weights`).
    """
    config = config or load_gguf_config(path)
    skipped = functools.partial(_is_skipped, skip=skip, fused=_fused_rows(config))
    cache_dir = cache_dir_for(path, "gguf-weights", _WEIGHTS_CACHE_VERSION)
    cached = os.path.join(cache_dir, "model.safetensors")
    if os.path.isfile(cached):
        return _stream_cached(cached, skipped)
    tensors, metadata = read_gguf_tensors(path)
    arch = metadata.get("general.architecture")
    plan = [
        (parts, name) for parts, name in _plan(tensors, path, config, arch) if not skipped(name)
    ]
    heads = _permuted_heads(metadata, config)
    weights = _stream(plan, heads, path, arch in _NORM_OFFSET_ARCHITECTURES)
    if skip or os.path.getsize(path) < _MIN_WEIGHTS_CACHE_BYTES:  # the cache holds all
        return weights
    return _stream_and_cache(weights, cache_dir)


def _plan(
    tensors: list[GGUFTensor], path: str, config: PreTrainedConfig, arch: Any
) -> list[PlanEntry]:
    """The file's tensors named as the parameters of `config`'s model."""
    if not isinstance(arch, str):
        raise ValueError(f"{path}: not a valid GGUF file: no general.architecture")
    return plan_tensors(tensors, path, model_tensor_names(config, arch))


def _stream_cached(
    cached: str, skipped: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(cached, framework="pt") as checkpoint:
        for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
            if not skipped(name):
                yield name, checkpoint.get_tensor(name)


def _stream_and_cache(
    weights: Iterator[tuple[str, torch.Tensor]], cache_dir: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the dequantized weights, then save them all for the next start: reading the
    GGUF tensor table and dequantizing costs seconds, a safetensors file is mapped at once."""
    kept: dict[str, torch.Tensor] = {}
    for name, weight in weights:
        kept[name] = weight
        yield name, weight

    def save(directory: str) -> None:
        os.makedirs(directory)
        save_file(kept, os.path.join(directory, "model.safetensors"))

    save_atomically(cache_dir, save)


def _stream(
    plan: list[PlanEntry], heads: dict[str, int], path: str, offset_norms: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    for parts, hf_name in plan:
        weight = _dequantize_parts(parts, path)
        projection = hf_name.split(".")[-2]
        if projection in heads:
            weight = _unpermute(weight, heads[projection], f"{path}: {parts[0].name}")
        if offset_norms and hf_name.endswith("norm.weight"):
            weight = weight - 1.0  # float32, as Transformers (see _NORM_OFFSET_ARCHITECTURES)
        yield hf_name, weight


def _permuted_heads(metadata: dict[str, Any], config: PreTrainedConfig) -> dict[str, int]:
    """Projection -> heads whose rows llama.cpp's converter permuted (Llama and Mistral)."""
    if metadata.get("general.architecture") not in _PERMUTED_ARCHITECTURES:
        return {}
    return {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}


def iter_gguf_raw_weights(
    path: str, config: PreTrainedConfig, types: frozenset[GGMLQuantizationType] | None = None
) -> Iterator[tuple[str, GGMLQuantizationType, np.ndarray]]:
    """Yield ``(hf_name, type, raw rows)`` for every 2-D weight of GGUF file ``path`` (of
    one of `types`, if given), its blocks left as stored: a uint8 array [rows, bytes per
    row] (q/k rows un-permuted like `iter_gguf_weights`: a copy), for layers that compute
    on the blocks themselves. Phi-3's fused tensors come as the projections they hold
    (q_proj, k_proj, v_proj; gate_proj, up_proj: row ranges of the file's blocks), as the
    other architectures' files store them."""
    tensors, metadata = read_gguf_tensors(path)
    heads = _permuted_heads(metadata, config)
    fused = _fused_rows(config)
    for parts, hf_name in _plan(tensors, path, config, metadata.get("general.architecture")):
        tensor = parts[0]
        if len(parts) > 1 or not hf_name.endswith(".weight") or len(tensor.shape) != 2:
            continue  # stacked experts and 1-D tensors are dequantized
        if types is not None and tensor.tensor_type not in types:
            continue
        rows = _raw_rows(tensor, hf_name, heads, path)
        for name, start, count in _row_ranges(hf_name, rows.shape[0], fused, path):
            yield name, tensor.tensor_type, rows[start : start + count]


def iter_gguf_raw_experts(
    path: str, config: PreTrainedConfig, types: frozenset[GGMLQuantizationType]
) -> Iterator[tuple[str, tuple[tuple[GGMLQuantizationType, np.ndarray], ...]]]:
    """Yield ``(hf_name, ((type, raw), ...))`` for every stacked-experts tensor of GGUF file
    ``path`` all of whose parts are of one of `types`: the parts in row order (gate, then
    up; down alone), each a read-only uint8 array [experts, rows, bytes per row] of the
    file's blocks, for layers that keep each expert on its blocks."""
    tensors, metadata = read_gguf_tensors(path)
    for parts, hf_name in _plan(tensors, path, config, metadata.get("general.architecture")):
        if len(parts[0].shape) != 3 or any(part.tensor_type not in types for part in parts):
            continue
        raws = (np.asarray(part.data) for part in parts)
        stacked = tuple(raw.reshape(raw.shape[0], raw.shape[1], -1) for raw in raws)
        yield hf_name, tuple((p.tensor_type, r) for p, r in zip(parts, stacked, strict=True))


def _raw_rows(tensor: GGUFTensor, hf_name: str, heads: dict[str, int], path: str) -> np.ndarray:
    """The tensor's blocks as [rows, bytes per row], q/k rows un-permuted."""
    raw = np.asarray(tensor.data)
    projection = hf_name.split(".")[-2]
    if projection in heads:
        rows = torch.from_numpy(raw.reshape(raw.shape[0], -1).copy())
        raw = _unpermute(rows, heads[projection], f"{path}: {tensor.name}").numpy()
    return raw.reshape(raw.shape[0], -1)


def _fused_rows(config: PreTrainedConfig) -> FusedRows:
    """The fused projections of checkpoints that store q/k/v and gate/up fused (Phi-3);
    empty for the others."""
    if (getattr(config, "architectures", None) or [""])[0] != "Phi3ForCausalLM":
        return {}
    from pagedllm.model.models.phi3 import fused_projection_rows

    return fused_projection_rows(config)


def _split_names(hf_name: str, fused: FusedRows) -> list[tuple[str, int]]:
    """(name, rows) of each projection fused tensor `hf_name` holds; empty if not fused."""
    parts = hf_name.split(".")
    if len(parts) < 2 or parts[-1] != "weight" or parts[-2] not in fused:
        return []
    return [(".".join([*parts[:-2], name, "weight"]), rows) for name, rows in fused[parts[-2]]]


def _row_ranges(
    hf_name: str, num_rows: int, fused: FusedRows, path: str
) -> list[tuple[str, int, int]]:
    """(name, first row, rows) of each projection in tensor `hf_name` (itself if not fused)."""
    split = _split_names(hf_name, fused)
    if not split:
        return [(hf_name, 0, num_rows)]
    if sum(rows for _, rows in split) != num_rows:
        raise ValueError(f"{path}: {hf_name} has {num_rows} rows; the config gives {split}")
    starts = np.cumsum([0] + [rows for _, rows in split]).tolist()
    return [(name, start, rows) for (name, rows), start in zip(split, starts, strict=False)]


def _is_skipped(hf_name: str, skip: frozenset[str], fused: FusedRows) -> bool:
    """In `skip`, or a fused tensor every projection of which is (its layer holds them all)."""
    split = _split_names(hf_name, fused)
    return hf_name in skip or (bool(split) and all(name in skip for name, _ in split))
