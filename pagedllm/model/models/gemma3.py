"""Gemma 3's text decoder (`Gemma3ForCausalLM`), from Hugging Face safetensors or a llama.cpp
GGUF file (`gguf_loader` turns the file into the same config and tensors).

Where it differs from Llama, each as Transformers computes it:
* the token embedding is multiplied by sqrt(hidden_size), cast to the model's dtype;
* Gemma's RMSNorm (`x * (1 + w)`, in float32: `layers/gemma_norm.py`) before and after
  both the attention and the MLP, and on every query and key head before RoPE;
* attention scores scaled by `query_pre_attn_scalar ** -0.5`, not head_dim's;
* sliding-window (local) and full (global) layers as `layer_types` says, each kind with its
  own RoPE (`rope_parameters[kind]`: its base, and the global one's linear scaling);
* a gated MLP with GELU (tanh approximation);
* the logits soft-capped, tanh(x / cap) * cap, where `final_logit_softcapping` is set.
Attention-score soft-capping and bidirectional attention are refused: the attention
backends compute plain causal softmax attention.

The projections, the head (tied to the embedding), weight loading (HF names, fused q/k/v
and gate/up shards), KV cache binding and tensor and pipeline parallelism are llama.py's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.attention import Attention, layer_sliding_windows
from pagedllm.model.layers.gemma_norm import GemmaRMSNorm
from pagedllm.model.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    _head_dim,
)
from pagedllm.ops import fused
from pagedllm.ops.attention import AttentionBackend
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection

SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
# Gemma 3 checkpoints use plain RoPE, and linear scaling on the global layers of the larger
# models; Transformers' other types are not served here.
SUPPORTED_ROPE_TYPES = ("default", "linear")


def check_gemma3_config(config: Any) -> None:
    """Refuse what this model cannot compute exactly (ValueError naming what is supported)."""
    attn_cap = getattr(config, "attn_logit_softcapping", None)
    if attn_cap is not None:
        raise ValueError(
            f"attn_logit_softcapping={attn_cap} is not supported (the attention backends do "
            "not soft-cap scores); supported: None"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            "use_bidirectional_attention=True is not supported; supported: causal attention"
        )
    activation = getattr(config, "hidden_activation", None) or SUPPORTED_ACTIVATIONS[0]
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"hidden_activation {activation!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ACTIVATIONS)}"
        )


def layer_rope_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    """The RoPE of one kind of layer: `rope_parameters[layer_type]`, where Transformers 5
    keeps it (a config's older `rope_theta`, `rope_local_base_freq` and `rope_scaling` are
    folded in there when it loads)."""
    params = (getattr(config, "rope_parameters", None) or {}).get(layer_type)
    if params is None:
        raise ValueError(f"rope_parameters has no entry for {layer_type!r} layers")
    params = dict(params)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} ({layer_type} layers) is not supported for Gemma 3; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    params["rope_type"] = rope_type
    return params


class Gemma3Attention(LlamaAttention):
    """Llama's attention with Gemma norms on the q/k heads and Gemma's score scale."""

    def __init__(
        self,
        config: Any,
        layer_index: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        kernels: KernelSelection,
    ) -> None:
        super().__init__(config, layer_index, backend, dtype, kernels)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype, kernels)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype, kernels)
        window = layer_sliding_windows(config)[layer_index]
        self.attn = Attention(backend, config.query_pre_attn_scalar**-0.5, window)


class Gemma3MLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up in one column-parallel projection."""

    def __init__(self, config: Any, dtype: torch.dtype, kernels: KernelSelection) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], ["gate", "up"], False, dtype, kernels
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, dtype, kernels)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.gelu_tanh_and_mul(self.gate_up_proj(x), self.kernels))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_index: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        kernels: KernelSelection,
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        # Which RoPE the layer takes: "sliding_attention" or "full_attention".
        self.layer_type: str = config.layer_types[layer_index]
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype, kernels)
        self.self_attn = Gemma3Attention(config, layer_index, backend, dtype, kernels)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype, kernels)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype, kernels)
        self.mlp = Gemma3MLP(config, dtype, kernels)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype, kernels)

    def forward(self, x, residual, positions, rotary: RotaryEmbedding, metadata):
        """(this layer's output, the residual stream before it), as Llama's layers: adding
        the output to the stream is left to the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x)[0], x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, metadata)
        h = self.post_attention_layernorm(h)[0]
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h = self.post_feedforward_layernorm(self.mlp(h))[0]
        return h, residual


class Gemma3Model(LlamaModel):
    """Llama's stack with Gemma's final norm, a RoPE per attention kind and the scaled
    embedding."""

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend,
        dtype: torch.dtype,
        max_len: int,
        kernels: KernelSelection,
        layer_class: type[nn.Module] = Gemma3DecoderLayer,
    ) -> None:
        super().__init__(config, backend, dtype, max_len, kernels, layer_class)
        # Applied here, not in the embedding module, so that a GGUF embedding swapped in for
        # it (quantization="gguf") is scaled too. Transformers rounds the scale to the
        # model's dtype (sqrt(3072) is 55.5 in bf16), and so does this.
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)

    def make_norm(self, config: Any, dtype: torch.dtype, kernels: KernelSelection) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, kernels)

    def make_rotary(self, config: Any, max_len: int, kernels: KernelSelection) -> nn.Module:
        kinds = sorted({config.layer_types[i] for i in self.stage_layers})
        return nn.ModuleDict(
            {
                kind: RotaryEmbedding(
                    _head_dim(config), max_len, layer_rope_parameters(config, kind), kernels
                )
                for kind in kinds
            }
        )

    def rotary_for(self, layer: nn.Module) -> nn.Module:
        return self.rotary[layer.layer_type]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Serves Gemma3ForCausalLM checkpoints: Gemma 3 270M and 1B as published, and the text
    decoder of a larger (multimodal) one saved as such, as llama.cpp's GGUF files hold it."""

    layer_class = Gemma3DecoderLayer
    model_class = Gemma3Model
    check_config = staticmethod(check_gemma3_config)

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend,
        dtype: torch.dtype,
        max_len: int,
        kernels: KernelSelection = TORCH_KERNELS,
    ):
        super().__init__(config, backend, dtype, max_len, kernels)
        self.final_logit_softcapping: float | None = getattr(
            config, "final_logit_softcapping", None
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return fused.soft_cap(logits, cap, self.kernels)
