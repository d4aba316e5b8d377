"""What a head's directory must hold to draft for a target, checked when the engine config
is built: an EAGLE head's config (a Llama layer or a few; `LlamaForCausalLMEagle3`-style for
"eagle3"), the target layers an EAGLE-3 head reads, Medusa's head count and sizes, and what
does not compose yet.

The head's `ModelConfig` sizes its KV in the pool (its own layers, same blocks as the
target's) as a draft model's does.
"""

from __future__ import annotations

import os
from typing import Any

from pagedllm.config import ModelConfig
from pagedllm.model.loader import load_hf_config, resolve_model
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.head_layers import aux_layers
from pagedllm.spec_decode.medusa_config import read_medusa_config


def build_head_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The head's `ModelConfig`; a ValueError naming what does not fit the target.

    Any parallel layout fits: the head runs whole on the sampling rank, reading the target's
    hidden states (whole on every tensor-parallel rank after each layer's all-reduce; an
    EAGLE-3 head's layers carried from the stages that run them, runner/stage_tap.py) and
    whole copies of its embedding and lm_head (spec_decode/runner/whole_target_parts.py)."""
    assert spec.uses_head and spec.model is not None
    source = resolve_model(spec.model)
    if source.is_gguf:
        raise ValueError(f"speculative_config: an EAGLE head is a directory, got {spec.model!r}")
    config = load_hf_config(source)
    _check_head(spec.method, config, target, source.path)
    return ModelConfig(
        model=source.path,
        hf_config=config,
        dtype=target.dtype,
        max_model_len=target.max_model_len,
        eos_token_ids=target.eos_token_ids,
        seed=target.seed,
        max_logprobs=target.max_logprobs,
    )


def _check_head(method: str, config: Any, target: ModelConfig, path: str) -> None:
    where = f"speculative_config: the {method} head {path!r}"
    if getattr(config, "num_hidden_layers", 0) < 1:
        raise ValueError(f"{where} has no decoder layer (num_hidden_layers)")
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"{where} has vocab_size {config.vocab_size}, the target {target.vocab_size}: a "
            "head drafts in its target's vocabulary (a smaller one is draft_vocab_size)"
        )
    if getattr(config, "add_para_norm", False):
        raise ValueError(f"{where} is a HASS head (add_para_norm), which is not served yet")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise ValueError(f"{where} has sliding-window attention, which is not served")
    target_hidden = target.hf_config.hidden_size
    if method == "eagle":
        if config.hidden_size != target_hidden:
            raise ValueError(
                f"{where} has hidden_size {config.hidden_size}, the target {target_hidden}: an "
                "EAGLE head reads the target's hidden states as they are"
            )
        return
    eagle_config = getattr(config, "eagle_config", None) or {}
    if eagle_config.get("use_aux_hidden_state") is False:
        raise ValueError(f"{where} reads no auxiliary layers (use_aux_hidden_state), not served")
    aux_layers(config, target.num_layers)
    own_target_hidden = getattr(config, "target_hidden_size", None)
    if own_target_hidden is not None and own_target_hidden != target_hidden:
        raise ValueError(
            f"{where} was trained on a target of hidden size {own_target_hidden}, this one "
            f"has {target_hidden}"
        )


def check_medusa_head(spec: SpeculativeConfig, target: ModelConfig):
    """Medusa heads (no KV, so no `ModelConfig`): a ValueError naming what does not fit the
    target. Any layout fits: the heads read the last stage's normed output, whole on its
    sampling rank, and score (without lm_heads of their own) with a whole copy of the
    target's lm_head there."""
    assert spec.method == "medusa" and spec.model is not None
    source = resolve_model(spec.model)
    if source.is_gguf or not os.path.isdir(source.path):
        raise ValueError(f"speculative_config: a Medusa head is a directory, got {spec.model!r}")
    config = read_medusa_config(source.path)
    where = f"speculative_config: the Medusa head {source.path!r}"
    if spec.num_speculative_tokens > config.num_heads:
        raise ValueError(
            f"{where} has {config.num_heads} heads: num_speculative_tokens "
            f"({spec.num_speculative_tokens}) must not exceed them (head i proposes the i-th "
            "token ahead)"
        )
    for name, own, target_value in (
        ("hidden_size", config.hidden_size, target.hf_config.hidden_size),
        ("vocab_size", config.vocab_size, target.vocab_size),
    ):
        if own is not None and own != target_value:
            raise ValueError(f"{where} has {name} {own}, the target {target_value}")
    truncated = config.truncated_vocab_size
    if truncated is not None and truncated != (config.vocab_size or target.vocab_size):
        raise ValueError(
            f"{where} drafts over a truncated vocabulary (truncated_vocab_size {truncated}, "
            "a token_map), which is not served yet"
        )
