"""GGUF tensor names <-> the Hugging Face parameter names, and the plan of a file.

The names come from gguf-py's `TensorNameMap` for the file's architecture, the table
llama.cpp's converter names tensors by; the parameters come from the Transformers model
the config describes (built on the meta device, so nothing is allocated), and the GGUF ->
HF direction is the inverse of gguf-py's map over those parameters (its table lists many
checkpoints' spellings of each tensor; a model has one). What gguf-py does not name is
logic of the format, kept here: a parameter Transformers stacks that the converter splits
(a mixture's gate and up experts, rows of each expert's gate then up), a stacked
parameter's ``.weight`` suffix, the tensors that only feed the config, and which table
an architecture gguf-py lacks reads by (a ``mistral`` file: llama's; a Qwen3-MoE model's
dense layers: Qwen3's).

The plan of a file maps and type-checks every tensor before any is dequantized, the parts
of a stacked parameter gathered in the order their rows follow each other. Names it cannot
map raise ``ValueError`` naming the tensor and gguf-py's version.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import version

import torch
from gguf import MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, TensorNameMap, get_tensor_name_map
from transformers import AutoModelForCausalLM, PreTrainedConfig

from pagedllm.model.gguf.reader import check_tensor_type
from pagedllm.model.gguf.tensor_table import GGUFTensor

GGUF_PY_VERSION = version("gguf")
_MODEL_ARCHS = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}
# gguf-py has no `mistral` architecture: llama.cpp writes Mistral files as `llama`, and a
# file that says `mistral` is read by llama's names.
_ARCH_ALIASES = {"mistral": "llama"}
# A Qwen3-MoE model's dense layers (`mlp_only_layers`; llama.cpp's converter knows none, and
# gguf-py's qwen3moe table lists no dense MLP) are read by the dense Qwen3's names.
_DENSE_ARCHS = {"qwen3moe": "qwen3"}
_SUFFIXES = (".weight", ".bias")
# Parameters Transformers stacks that the converter stores split: the parameters gguf-py
# names for the parts, in the order their rows follow each other (dim 1 of the stack).
_STACKED_PARTS: dict[str, tuple[str, ...]] = {"gate_up_proj": ("gate_proj", "up_proj")}
# Not parameters of the HF model: their content is folded into the config.
_CONFIG_ONLY_TENSORS = frozenset(
    f"{TENSOR_NAMES[kind]}.weight"
    for kind in (
        MODEL_TENSOR.ROPE_FREQS,
        MODEL_TENSOR.ROPE_FACTORS_LONG,
        MODEL_TENSOR.ROPE_FACTORS_SHORT,
    )
)

# HF parameter -> the GGUF tensors it is stored as (one, or a stacked parameter's parts).
TensorNames = dict[str, tuple[str, ...]]
# The GGUF tensors one HF tensor is made of, in row order, and that HF tensor's name.
PlanEntry = tuple[tuple[GGUFTensor, ...], str]


def tensor_name_maps(arch: str, num_blocks: int) -> tuple[TensorNameMap, ...]:
    """gguf-py's HF -> GGUF name maps for GGUF architecture `arch` (general.architecture),
    the architecture's own first."""
    arch = _ARCH_ALIASES.get(arch, arch)
    if arch not in _MODEL_ARCHS:
        raise ValueError(f"gguf-py {GGUF_PY_VERSION} has no tensor names for {arch!r}")
    archs = [arch] + ([_DENSE_ARCHS[arch]] if arch in _DENSE_ARCHS else [])
    return tuple(get_tensor_name_map(_MODEL_ARCHS[name], num_blocks) for name in archs)


def _gguf_name(hf_name: str, name_maps: tuple[TensorNameMap, ...]) -> str | None:
    for name_map in name_maps:
        name = name_map.get_name(hf_name, try_suffixes=_SUFFIXES)
        if name is not None:
            return name
    return None


def gguf_names(hf_name: str, name_maps: tuple[TensorNameMap, ...]) -> tuple[str, ...]:
    """The GGUF tensors parameter `hf_name` is stored as: one, or a stacked parameter's
    parts in row order; () where gguf-py names none."""
    # Transformers names a stacked parameter without a suffix; the converter adds .weight.
    stored = hf_name if hf_name.endswith(_SUFFIXES) else f"{hf_name}.weight"
    name = _gguf_name(stored, name_maps)
    if name is not None:
        return (name,)
    module, last, suffix = stored.rsplit(".", 2)
    parts = [
        _gguf_name(f"{module}.{part}.{suffix}", name_maps) for part in _STACKED_PARTS.get(last, ())
    ]
    return tuple(parts) if parts and None not in parts else ()


def gguf_tensor_names(hf_names: Iterable[str], arch: str, num_blocks: int) -> TensorNames:
    """GGUF tensors of each parameter in `hf_names` that gguf-py names (the others left out)."""
    name_maps = tensor_name_maps(arch, num_blocks)
    names = {hf_name: gguf_names(hf_name, name_maps) for hf_name in hf_names}
    return {hf_name: stored for hf_name, stored in names.items() if stored}


def transformers_parameter_names(config: PreTrainedConfig) -> list[str]:
    """The names of the parameters of the Transformers model `config` describes."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return list(model.state_dict())  # a tied head included: a file may store it


def model_tensor_names(config: PreTrainedConfig, arch: str) -> TensorNames:
    """GGUF tensors of each parameter of `config`'s model, for a file of architecture `arch`."""
    hf_names = transformers_parameter_names(config)
    return gguf_tensor_names(hf_names, arch, config.num_hidden_layers)


def hf_names_by_gguf(names: TensorNames) -> dict[str, str]:
    """GGUF tensor -> the parameter it holds (all of it, or a stacked parameter's part)."""
    by_gguf: dict[str, str] = {}
    for hf_name, stored in names.items():
        for gguf_name in stored:
            if by_gguf.setdefault(gguf_name, hf_name) != hf_name:
                raise ValueError(
                    f"gguf-py {GGUF_PY_VERSION} names both {by_gguf[gguf_name]} and "
                    f"{hf_name} {gguf_name}"
                )
    return by_gguf


def plan_tensors(tensors: list[GGUFTensor], path: str, names: TensorNames) -> list[PlanEntry]:
    """Map and type-check every tensor before any is dequantized; `names` from
    `model_tensor_names`."""
    by_gguf = hf_names_by_gguf(names)
    parts: dict[str, list[GGUFTensor]] = {}
    for tensor in tensors:
        if tensor.name in _CONFIG_ONLY_TENSORS:
            continue
        check_tensor_type(tensor, path)
        if tensor.name not in by_gguf:
            raise ValueError(
                f"{path}: unknown GGUF tensor name {tensor.name!r} (gguf-py "
                f"{GGUF_PY_VERSION} names no parameter of the model so)"
            )
        parts.setdefault(by_gguf[tensor.name], []).append(tensor)
    return [(_ordered_parts(name, names[name], found, path), name) for name, found in parts.items()]


def _ordered_parts(
    hf_name: str, order: tuple[str, ...], found: list[GGUFTensor], path: str
) -> tuple[GGUFTensor, ...]:
    """`found` in the order their rows are stacked; every part must be there."""
    by_name = {tensor.name: tensor for tensor in found}
    missing = [name for name in order if name not in by_name]
    if missing:
        have = ", ".join(tensor.name for tensor in found)
        raise ValueError(f"{path}: {hf_name} needs {order}; the file has only {have}")
    return tuple(by_name[name] for name in order)
