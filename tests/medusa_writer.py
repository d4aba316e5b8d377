"""Medusa head directories as published, with seeded random weights, for tests:
FasterDecoding's (config.json with `medusa_num_heads` / `medusa_num_layers`, heads in
`medusa_lm_head.pt` or `.safetensors` as `{i}.{j}.linear.*` then `{i}.{num_layers}.weight`)
and vLLM's converted one (`num_heads`, `hidden_size`, ...; `blocks.{i}.layers.{j}.*` and
`lm_heads.{i}.weight` in model.safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from head_files import write_head_files


def random_heads(
    target: Any, num_heads: int, num_layers: int, bias: bool, seed: int
) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor | None]]], list[torch.Tensor]]:
    """(per head, per block: (weight, bias or None)), and per head its lm_head weight."""
    generator = torch.Generator().manual_seed(seed)
    hidden, vocab = target.hidden_size, target.vocab_size

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    blocks = [
        [
            (randn(hidden, hidden, scale=0.2), randn(hidden, scale=0.1) if bias else None)
            for _ in range(num_layers)
        ]
        for _ in range(num_heads)
    ]
    lm_heads = [randn(vocab, hidden, scale=2.0) for _ in range(num_heads)]
    return blocks, lm_heads


def write_fasterdecoding_heads(
    directory: Path,
    target: Any,
    num_heads: int = 4,
    num_layers: int = 1,
    seed: int = 0,
    pickled: bool = True,
    lm_heads: list[torch.Tensor] | None = None,
) -> Path:
    """FasterDecoding's layout (its ResBlocks always have a bias); `pickled`: as
    `medusa_lm_head.pt` (torch.save), else `medusa_lm_head.safetensors`."""
    blocks, random_lm_heads = random_heads(target, num_heads, num_layers, True, seed)
    lm_heads = lm_heads if lm_heads is not None else random_lm_heads
    tensors = {}
    for head, layers in enumerate(blocks):
        for layer, (weight, bias) in enumerate(layers):
            tensors[f"{head}.{layer}.linear.weight"] = weight
            tensors[f"{head}.{layer}.linear.bias"] = bias
        tensors[f"{head}.{num_layers}.weight"] = lm_heads[head]
    config = {
        "medusa_num_heads": num_heads,
        "medusa_num_layers": num_layers,
        "base_model_name_or_path": "tiny-target",
        "transformers_version": "4.40.0",
    }
    weights_file = "medusa_lm_head.pt" if pickled else "medusa_lm_head.safetensors"
    return write_head_files(directory, config, tensors, weights_file)


def write_vllm_heads(
    directory: Path,
    target: Any,
    num_heads: int = 3,
    num_layers: int = 2,
    bias: bool = False,
    original_lm_head: bool = False,
    own_lm_heads: bool = True,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """vLLM's converted layout; `original_lm_head`: one lm_head (`lm_heads.0`) for every
    head; `own_lm_heads` False: none at all (the target's scores)."""
    blocks, lm_heads = random_heads(target, num_heads, num_layers, bias, seed)
    tensors = {}
    for head, layers in enumerate(blocks):
        for layer, (weight, layer_bias) in enumerate(layers):
            tensors[f"blocks.{head}.layers.{layer}.weight"] = weight
            if layer_bias is not None:
                tensors[f"blocks.{head}.layers.{layer}.bias"] = layer_bias
    if own_lm_heads:
        for head in range(1 if original_lm_head else num_heads):
            tensors[f"lm_heads.{head}.weight"] = lm_heads[head]
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "num_heads": num_heads,
        "num_hidden_layers": num_layers,
        "medusa_fc_bias": bias,
        "original_lm_head": original_lm_head,
        **config_overrides,
    }
    return write_head_files(directory, config, tensors, "model.safetensors")
