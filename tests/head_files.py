"""Writing a speculative head's directory for tests: its config.json and one weights file,
safetensors or pickled (torch.save), under the file name its published layout uses."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_head_files(
    directory: Path, config: dict, tensors: dict[str, torch.Tensor], weights_file: str
) -> Path:
    """`directory` with config.json and `weights_file` (a .safetensors name is written with
    safetensors, any other with torch.save)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    if weights_file.endswith(".safetensors"):
        save_file(tensors, directory / weights_file)
    else:
        torch.save(tensors, directory / weights_file)
    return directory
