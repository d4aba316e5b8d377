"""The trained head's directory in the published EAGLE-3 layout (`LlamaForCausalLMEagle3`
config with `draft_vocab_size` and `eagle_config`, model.safetensors with `midlayer.*`,
`fc`, `norm`, `lm_head`, `d2t` and `t2d`), as spec_decode/runner/eagle_loading.py reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from benchmarks.eagle_train.head_model import TrainableEagle3Head
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
