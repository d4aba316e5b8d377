"""Mixture-of-experts decoders on the Llama layers: Mixtral and Qwen3-MoE.

Owns which layers are sparse, each architecture's routing (`MoESpec`: Mixtral always
renormalizes its top-k weights and keeps them fp32; Qwen3-MoE renormalizes only with
`norm_topk_prob` and casts them to the hidden dtype), and where expert checkpoint tensors
go. Attention, norms, tensor- and pipeline-parallel layout are the Llama model's; the
block itself is `layers/fused_moe.py`.

Checkpoints name experts one by one (Hub files, and what Transformers' `save_pretrained`
writes): Mixtral `block_sparse_moe.experts.E.w1|w3|w2.weight` (gate, up, down) and
`block_sparse_moe.gate.weight`; Qwen3-MoE `mlp.experts.E.gate_proj|up_proj|down_proj.weight`
and `mlp.gate.weight`. Transformers' in-memory names, the experts stacked
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), load too: they
are the parameters' own names. Checkpoints stored packed (GPTQ, AWQ, compressed-tensors
pack-quantized) quantize each expert's projections under the same names (`...w1.qweight`,
`...gate_proj.weight_packed`) and leave the router unquantized; `packed_swap` puts those
experts on their packed integers before the loader reads the rest.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.model.layers.fused_moe import FusedMoE, MoESpec
from pagedllm.model.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagedllm.ops.kernel_selection import KernelSelection

# model.layers.N.mlp.experts.E.<projection>.weight (Mixtral's block_sparse_moe renamed to mlp).
_EXPERT_TENSOR = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
# Checkpoint projection -> (stacked parameter, shard): Mixtral's w1/w3/w2 and Qwen's names.
_EXPERT_PROJECTIONS = {
    "w1": ("gate_up_proj", "gate"),
    "w3": ("gate_up_proj", "up"),
    "w2": ("down_proj", "down"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", "down"),
}


def _require_silu(config: Any) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")


def _num_experts(config: Any) -> int:
    """Transformers 5 stores both architectures' count as `num_local_experts` (Qwen3-MoE's
    `num_experts` is an alias); older configs and plain namespaces may hold either."""
    for name in ("num_local_experts", "num_experts"):
        if (value := getattr(config, name, None)) is not None:
            return int(value)
    return 0


def mixtral_spec(config: Any) -> MoESpec:
    _require_silu(config)
    return MoESpec(
        num_experts=_num_experts(config),
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        renormalize=True,
        weights_in_hidden_dtype=False,
    )


def qwen3_moe_spec(config: Any) -> MoESpec:
    _require_silu(config)
    return MoESpec(
        num_experts=_num_experts(config),
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        weights_in_hidden_dtype=True,
    )


def qwen3_moe_is_sparse(config: Any, layer_index: int) -> bool:
    """Transformers' rule: experts unless the layer is in `mlp_only_layers`, the model has
    none, or `layer_index + 1` is not a multiple of `decoder_sparse_step`."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_index not in mlp_only and _num_experts(config) > 0 and (layer_index + 1) % step == 0
    )


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(
        self, config: Any, layer_index: int, dtype: torch.dtype, kernels: KernelSelection
    ) -> nn.Module:
        return FusedMoE(mixtral_spec(config), dtype, kernels)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(
        self, config: Any, layer_index: int, dtype: torch.dtype, kernels: KernelSelection
    ) -> nn.Module:
        if qwen3_moe_is_sparse(config, layer_index):
            return FusedMoE(qwen3_moe_spec(config), dtype, kernels)
        # A dense layer: a Llama MLP of config.intermediate_size.
        return LlamaMLP(config, dtype, kernels)


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama decoder whose layers build an MoE block; loads per-expert tensors."""

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        name = self.rename_checkpoint_tensor(name)
        match = _EXPERT_TENSOR.match(name)
        if match is None or match.group(3) not in _EXPERT_PROJECTIONS:
            return super().checkpoint_target(name)
        prefix, expert, projection = match.groups()
        param_name, shard = _EXPERT_PROJECTIONS[projection]
        return f"{prefix}.{param_name}", (int(expert), shard)

    def rename_checkpoint_tensor(self, name: str) -> str:
        """The checkpoint's name as this model's modules spell it."""
        return name

    # The checkpoint's names of an expert's gate, up and down (Qwen's; Mixtral's below).
    expert_projection_names: ClassVar[dict[str, str]] = {
        "gate": "gate_proj",
        "up": "up_proj",
        "down": "down_proj",
    }

    def checkpoint_expert_layer(self, experts_name: str, expert: int, shard: str) -> str:
        """The checkpoint name (without `.weight`) of one expert's gate, up or down, for
        what reads a quantization config by layer names (dummy weights)."""
        return f"{experts_name}.{expert}.{self.expert_projection_names[shard]}"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        for index, layer in zip(self.model.stage_layers, self.model.own_layers(), strict=True):
            if isinstance(layer.mlp, FusedMoE) and (missing := layer.mlp.experts.missing_shards()):
                raise ValueError(
                    f"checkpoint is missing layer {index}'s expert weights (expert, shard): "
                    f"{missing[:8]}"
                )


class MixtralForCausalLM(MoEForCausalLM):
    """Serves MixtralForCausalLM checkpoints: every layer sparse."""

    layer_class = MixtralDecoderLayer
    expert_projection_names: ClassVar[dict[str, str]] = {"gate": "w1", "up": "w3", "down": "w2"}

    def rename_checkpoint_tensor(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")

    def checkpoint_expert_layer(self, experts_name: str, expert: int, shard: str) -> str:
        layer = super().checkpoint_expert_layer(experts_name, expert, shard)
        return layer.replace(".mlp.", ".block_sparse_moe.")


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Serves Qwen3MoeForCausalLM checkpoints: per-head q/k norm (the Llama attention's),
    sparse layers as `qwen3_moe_is_sparse` says, dense ones of `intermediate_size`."""

    layer_class = Qwen3MoeDecoderLayer
