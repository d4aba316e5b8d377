"""Reading a Medusa head directory into `MedusaHeads`, in either published layout.

- FasterDecoding's (`medusa_lm_head.safetensors` or `medusa_lm_head.pt`, or beside a whole
  model under `medusa_head.`): head i is an `nn.Sequential` of `medusa_num_layers`
  ResBlocks then its lm_head, so `{i}.{j}.linear.weight` / `.bias` for block j and
  `{i}.{num_layers}.weight` for the lm_head.
- vLLM's converted one (`model.safetensors` or `pytorch_model.bin`, names possibly under
  `medusa_heads.`): `blocks.{i}.layers.{j}.weight` (a bias with `medusa_fc_bias`) and
  `lm_heads.{i}.weight`; with `original_lm_head` one lm_head (`lm_heads.0` or `lm_head`)
  scores for every head.

Only the first `num_speculative_tokens` heads are built; a head without an lm_head scores
with the target's. A whole model's own tensors beside the heads (`model.*`) are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from pagedllm.spec_decode.medusa_config import MedusaConfig
from pagedllm.spec_decode.runner.eagle_loading import iter_head_files
from pagedllm.spec_decode.runner.medusa_head import MedusaHeads

# FasterDecoding's file names, then vLLM's.
PICKLED_FILES = ("medusa_lm_head.pt", "pytorch_model.bin")
_PREFIXES = ("medusa_heads.", "medusa_head.")
_VLLM_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
_VLLM_LM_HEAD = re.compile(r"lm_heads\.(\d+)\.weight")
_FD_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
_FD_LAST = re.compile(r"(\d+)\.(\d+)\.weight")


@dataclass
class HeadTensors:
    """A checkpoint's tensors by role, whatever its layout."""

    blocks: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)
    lm_heads: dict[int, torch.Tensor] = field(default_factory=dict)
    shared_lm_head: torch.Tensor | None = None  # vLLM's `lm_head` (original_lm_head)


def read_medusa_tensors(directory: str, config: MedusaConfig) -> HeadTensors:
    found = HeadTensors()
    for name, tensor in iter_head_files(directory, PICKLED_FILES):
        _place(found, name, tensor, config)
    return found


def _place(found: HeadTensors, name: str, tensor: torch.Tensor, config: MedusaConfig) -> None:
    if name.startswith("model.") or name == "token_map":
        return  # a whole model's own tensors; a token_map of the full vocabulary is unused
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    if name == "lm_head.weight":
        if config.original_lm_head:
            found.shared_lm_head = tensor
        return  # otherwise the base model's, beside FasterDecoding's heads
    if match := _VLLM_BLOCK.fullmatch(name) or _FD_BLOCK.fullmatch(name):
        head, layer, kind = match.groups()
        found.blocks[int(head), int(layer), kind] = tensor
    elif match := _VLLM_LM_HEAD.fullmatch(name):
        found.lm_heads[int(match.group(1))] = tensor
    elif match := _FD_LAST.fullmatch(name):
        head, layer = int(match.group(1)), int(match.group(2))
        if layer != config.num_layers:
            raise ValueError(
                f"speculative_config: Medusa tensor {name!r} does not fit heads of "
                f"{config.num_layers} residual blocks (medusa_num_layers)"
            )
        found.lm_heads[head] = tensor
    else:
        raise ValueError(f"speculative_config: tensor {name!r} has no place in Medusa heads")


def build_medusa_heads(
    config: MedusaConfig,
    tensors: HeadTensors,
    num_heads: int,
    hidden_size: int,
    vocab_size: int,
    dtype: torch.dtype,
    kernels,
) -> MedusaHeads:
    """The first `num_heads` heads with their weights (the target's logits still to share)."""
    bias = (0, 0, "bias") in tensors.blocks
    lm_head_of, own = _lm_head_sources(config, tensors, num_heads)
    heads = MedusaHeads(
        num_heads,
        config.num_layers,
        hidden_size,
        vocab_size,
        bias,
        lm_head_of,
        dtype,
        kernels,
        config.logit_scale,
    )
    for head in range(num_heads):
        for layer in range(config.num_layers):
            linear = heads.blocks[head].layers[layer]
            kinds = ("weight", "bias") if bias else ("weight",)
            for kind in kinds:
                tensor = tensors.blocks.get((head, layer, kind))
                if tensor is None:
                    raise ValueError(
                        f"speculative_config: the Medusa heads lack the {kind} of head "
                        f"{head}'s residual block {layer}"
                    )
                _load(getattr(linear, kind), tensor)
    for index, tensor in enumerate(own):
        _load(heads.lm_heads[index].weight, tensor)
    return heads.eval()


def _lm_head_sources(config: MedusaConfig, tensors: HeadTensors, num_heads: int):
    """(each head's index among the lm_heads built, None for the target's; their tensors)."""
    if config.original_lm_head:
        shared = tensors.shared_lm_head
        if shared is None:
            shared = tensors.lm_heads.get(0)
        return [None if shared is None else 0] * num_heads, [] if shared is None else [shared]
    lm_head_of: list[int | None] = []
    own: list[torch.Tensor] = []
    for head in range(num_heads):
        tensor = tensors.lm_heads.get(head)
        lm_head_of.append(None if tensor is None else len(own))
        if tensor is not None:
            own.append(tensor)
    return lm_head_of, own


def _load(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"speculative_config: a Medusa tensor of shape {list(tensor.shape)} where the "
            f"target's sizes need {list(param.shape)}"
        )
    param.weight_loader(param, tensor.to(param.dtype))
