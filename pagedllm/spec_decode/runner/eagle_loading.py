"""Reading an EAGLE head's directory into `Eagle3Head` / `EagleHead`, as published.

EAGLE-3 (SpecForge and the EAGLE authors' `LlamaForCausalLMEagle3` checkpoints): `fc`,
`midlayer.*` (or `layers.0.*`) with `hidden_norm`, `norm`, optionally `lm_head` over
`draft_vocab_size` tokens with `d2t` (draft -> target id offsets; `t2d`, the target ->
draft mask, is not needed), optionally `embed_tokens`. EAGLE (EAGLE-1/2): `fc` (with or
without a bias), `layers.0.*` (its unused input norm skipped); the embedding and lm_head
are always the target's, as vLLM serves them. Tensors come from *.safetensors, else
pytorch_model.bin; a leading "model." is dropped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from pagedllm.model.loader import ModelSource, iter_weights
from pagedllm.model.models.llama import fused_param_name, load_param
from pagedllm.spec_decode.head_layers import aux_layers
from pagedllm.spec_decode.runner.eagle_head import Eagle3Head, EagleHead, TargetParts
from pagedllm.spec_decode.runner.proposer import TargetStates


def read_head_tensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of the head, by its checkpoint name without a leading "model."."""
    return {_strip_model(name): tensor for name, tensor in iter_head_files(directory)}


def iter_head_files(
    directory: str, pickled: tuple[str, ...] = ("pytorch_model.bin",)
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the head's *.safetensors files, else of the first of `pickled`
    (torch.save files) the directory holds."""
    if any(name.endswith(".safetensors") for name in os.listdir(directory)):
        yield from iter_weights(ModelSource(directory, False), None)
        return
    for file_name in pickled:
        path = os.path.join(directory, file_name)
        if os.path.isfile(path):
            yield from torch.load(path, map_location="cpu", weights_only=True).items()
            return
    raise ValueError(
        f"speculative_config: the head {directory!r} has no *.safetensors files nor "
        f"{' nor '.join(pickled)}"
    )


def _strip_model(name: str) -> str:
    return name.removeprefix("model.")


def build_head(
    method: str,
    config: Any,
    tensors: dict[str, torch.Tensor],
    target_config: Any,
    shared: TargetParts,
    backend,
    dtype: torch.dtype,
    max_len: int,
    kernels,
    directory: str,
) -> tuple[torch.nn.Module, TargetStates]:
    """The head of `method` (read from `directory`) with its weights, sharing what it lacks
    with its target (`shared`; `target_config` its Hugging Face config), and the target's
    states it reads."""
    if method == "eagle3":
        layers = aux_layers(config, target_config.num_hidden_layers)
        head = Eagle3Head(
            config,
            backend,
            dtype,
            max_len,
            kernels,
            own_embeddings="embed_tokens.weight" in tensors,
            own_lm_head="lm_head.weight" in tensors,
            target_hidden_size=target_config.hidden_size,
            num_target_states=len(layers),
        )
        states = TargetStates(layers)
    else:
        head = EagleHead(config, backend, dtype, max_len, kernels, "fc.bias" in tensors)
        states = TargetStates()
    head.share_target(shared)
    _load(head, method, tensors, directory)
    return head.eval(), states


def _load(
    head: torch.nn.Module, method: str, tensors: dict[str, torch.Tensor], directory: str
) -> None:
    params = dict(head.named_parameters())
    unloaded = set(params)
    for name, tensor in tensors.items():
        target_name = _head_name(method, name)
        if target_name is None:
            continue
        if target_name == "d2t":
            head.d2t.copy_(checked_d2t(tensor, head.draft_vocab_size, head.vocab_size, directory))
            continue
        param_name, shard_id = fused_param_name(target_name)
        if param_name not in params:
            raise ValueError(
                f"speculative_config: head tensor {name!r} has no place in a {method} head"
            )
        param = params[param_name]
        load_param(param, tensor.to(param.dtype), shard_id)
        unloaded.discard(param_name)
    if unloaded:
        raise ValueError(f"speculative_config: the head is missing weights for {sorted(unloaded)}")


def checked_d2t(d2t: torch.Tensor, draft_vocab_size: int, vocab_size: int, directory: str):
    """int64 `d2t` once every draft id maps inside the target's vocabulary: checked at
    start-up, since an id past it fails a step and a negative one indexes from the end."""
    problem = _d2t_problem(d2t, draft_vocab_size, vocab_size)
    if problem is not None:
        raise ValueError(f"speculative_config: the head {directory!r}: d2t {problem}")
    return d2t.long()


def _d2t_problem(d2t: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> str | None:
    if tuple(d2t.shape) != (draft_vocab_size,):
        return f"has shape {tuple(d2t.shape)}, not ({draft_vocab_size},)"
    if d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool:
        return f"is {d2t.dtype}, not integer offsets"
    target_ids = torch.arange(draft_vocab_size) + d2t.long()
    if draft_vocab_size and not (target_ids.min() >= 0 and target_ids.max() < vocab_size):
        return f"maps draft ids outside the target's {vocab_size} tokens"
    return None


def _head_name(method: str, name: str) -> str | None:
    """The head's name for checkpoint tensor `name`, or None for one it does not read."""
    if name == "t2d" or "rotary_emb.inv_freq" in name:
        return None
    if method == "eagle" and name == "embed_tokens.weight":
        return None  # vLLM serves EAGLE heads on their target's embedding
    for prefix in ("midlayer.", "layers.0."):
        if name.startswith(prefix):
            rest = name.removeprefix(prefix)
            if method == "eagle" and rest.startswith("input_layernorm."):
                return None  # EAGLE's first layer has no input norm
            return "first_layer." + rest
    if name.startswith("layers."):
        index, _, rest = name.removeprefix("layers.").partition(".")
        return f"later_layers.{int(index) - 1}.{rest}"
    return name
