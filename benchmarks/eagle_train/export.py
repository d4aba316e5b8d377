"""The trained head's directory in the published EAGLE-3 layout (`LlamaForCausalLMEagle3`
config with `draft_vocab_size` and `eagle_config`, model.safetensors with `midlayer.*`,
`fc`, `norm`, `lm_head`, `d2t` and `t2d`), as spec_decode/runner/eagle_loading.py reads it;
and such a directory read back into the training module (`read_head_dir`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from benchmarks.eagle_train.head_model import HeadSizes, TrainableEagle3Head
from benchmarks.eagle_train.vocab import DraftVocab


def head_config(target: Any, head: TrainableEagle3Head, layers: tuple[int, ...]) -> dict:
    sizes = head.sizes
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": sizes.hidden,
        "intermediate_size": sizes.intermediate,
        "num_attention_heads": sizes.num_heads,
        "num_key_value_heads": sizes.num_kv_heads,
        "head_dim": sizes.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": sizes.draft_vocab,
        "rms_norm_eps": sizes.rms_norm_eps,
        "rope_theta": sizes.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "target_hidden_size": target.hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(layers),
            "use_aux_hidden_state": True,
        },
    }


def write_head_dir(
    directory: Path,
    target: Any,
    head: TrainableEagle3Head,
    vocab: DraftVocab,
    layers: tuple[int, ...],
    extra: dict | None = None,
) -> Path:
    """config.json, model.safetensors, and training.json (how it was made: `extra`)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = head.published_tensors()
    tensors["d2t"] = vocab.d2t
    tensors["t2d"] = vocab.t2d
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(head_config(target, head, layers), indent=2))
    if extra is not None:
        (directory / "training.json").write_text(json.dumps(extra, indent=2))
    return directory


def read_head_dir(
    directory: Path, target_embedding: torch.Tensor
) -> tuple[TrainableEagle3Head, DraftVocab, tuple[int, ...]]:
    """A head `write_head_dir` wrote (or one in its layout, sharing the target's embedding):
    the module with its weights, its draft vocabulary and the target layers it reads."""
    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(directory / "model.safetensors")
    layers = tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    sizes = HeadSizes(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        num_target_states=len(layers),
        draft_vocab=config["draft_vocab_size"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
    )
    head = TrainableEagle3Head(sizes, target_embedding)
    with torch.no_grad():
        for name, param in head.published_parameters().items():
            param.copy_(tensors[name].float())
    target_ids = torch.arange(sizes.draft_vocab) + tensors["d2t"].long()
    return head, DraftVocab(target_ids, config["vocab_size"]), layers
