"""EAGLE head directories as published, with seeded random weights, for tests: EAGLE-3
(`LlamaForCausalLMEagle3`: `midlayer.*`, `fc` over three target layers, a draft vocabulary
with `d2t`/`t2d`) and EAGLE (`layers.0.*`, `fc` over [embedding, hidden])."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from head_files import write_head_files


def head_config(target: Any, **overrides) -> dict[str, Any]:
    """A one-layer Llama config of the target's sizes (a head's config.json)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "num_hidden_layers": 1,
        "vocab_size": target.vocab_size,
        "rms_norm_eps": target.rms_norm_eps,
        "max_position_embeddings": target.max_position_embeddings,
        "tie_word_embeddings": False,
        **overrides,
    }


def layer_tensors(prefix: str, config: dict, qkv_input: int, seed: int) -> dict:
    """One Llama decoder layer's tensors, q/k/v reading `qkv_input` features."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    return {
        f"{prefix}self_attn.q_proj.weight": weight(hidden, qkv_input),
        f"{prefix}self_attn.k_proj.weight": weight(kv, qkv_input),
        f"{prefix}self_attn.v_proj.weight": weight(kv, qkv_input),
        f"{prefix}self_attn.o_proj.weight": weight(hidden, hidden),
        f"{prefix}mlp.gate_proj.weight": weight(inter, hidden),
        f"{prefix}mlp.up_proj.weight": weight(inter, hidden),
        f"{prefix}mlp.down_proj.weight": weight(hidden, inter),
        f"{prefix}input_layernorm.weight": 1 + weight(hidden),
        f"{prefix}post_attention_layernorm.weight": 1 + weight(hidden),
    }


def write_head(
    directory: Path, config: dict, tensors: dict[str, torch.Tensor], bin_file: bool = False
) -> Path:
    """config.json and model.safetensors (`bin_file`: pytorch_model.bin, as the EAGLE
    authors' heads are published)."""
    weights_file = "pytorch_model.bin" if bin_file else "model.safetensors"
    return write_head_files(directory, config, tensors, weights_file)


def write_eagle3_head(
    directory: Path,
    target: Any,
    draft_vocab_size: int | None = None,
    aux_layers: list[int] | None = None,
    own_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """An EAGLE-3 head; `draft_vocab_size` (fewer than the target's tokens): its own
    lm_head over a random subset of the target's vocabulary, mapped by d2t."""
    overrides: dict[str, Any] = {"architectures": ["LlamaForCausalLMEagle3"]}
    if aux_layers is not None:
        overrides["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    hidden, vocab = target.hidden_size, target.vocab_size
    generator = torch.Generator().manual_seed(seed + 1)
    draft_vocab = draft_vocab_size or vocab
    overrides["draft_vocab_size"] = draft_vocab
    config = head_config(target, **overrides)
    tensors = layer_tensors("midlayer.", config, 2 * hidden, seed)
    tensors["midlayer.hidden_norm.weight"] = torch.ones(hidden)
    tensors["fc.weight"] = torch.randn(hidden, 3 * hidden, generator=generator) * 0.2
    tensors["norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = torch.randn(draft_vocab, hidden, generator=generator)
    kept = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    tensors["d2t"] = kept - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    tensors["t2d"] = t2d
    if own_embeddings:
        tensors["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=generator)
    return write_head(directory, config, tensors)


def write_eagle_head(
    directory: Path, target: Any, fc_bias: bool = True, seed: int = 0, bin_file: bool = False
) -> Path:
    """An EAGLE (EAGLE-1/2) head, its (unused) embedding and input norm included as the
    EAGLE authors' checkpoints hold them."""
    config = head_config(target)
    hidden = target.hidden_size
    generator = torch.Generator().manual_seed(seed + 1)
    tensors = layer_tensors("layers.0.", config, hidden, seed)
    tensors["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.2
    if fc_bias:
        tensors["fc.bias"] = torch.randn(hidden, generator=generator) * 0.1
    tensors["embed_tokens.weight"] = torch.randn(target.vocab_size, hidden, generator=generator)
    return write_head(directory, config, tensors, bin_file)
