"""Llama-family decoder: Llama 2/3 and SmolLM2, Mistral (full attention), Qwen2 (q/k/v bias)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.linear import Linear, MergedLinear, default_weight_loader
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.ops import fused
from pagedllm.ops.attention import AttentionBackend, AttentionMetadata
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection

# Checkpoint projection name -> (fused parameter name, shard id).
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _num_kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _biases(config: Any) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias): Qwen2 always biases q/k/v only; Llama follows attention_bias."""
    architecture = (getattr(config, "architectures", None) or [""])[0]
    if architecture == "Qwen2ForCausalLM":
        return True, False
    attention_bias = bool(getattr(config, "attention_bias", False))
    return attention_bias, attention_bias


class LlamaAttention(nn.Module):
    def __init__(
        self, config: Any, backend: AttentionBackend, dtype: torch.dtype, kernels: KernelSelection
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = _num_kv_heads(config)
        self.head_dim = _head_dim(config)
        self.scale = self.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_bias, o_bias = _biases(config)
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            [q_size, kv_size, kv_size],
            ["q", "k", "v"],
            qkv_bias,
            dtype,
            kernels,
        )
        self.o_proj = Linear(q_size, config.hidden_size, o_bias, dtype, kernels)
        self.backend = backend
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x, positions, rotary: RotaryEmbedding, metadata: AttentionMetadata):
        num_tokens = x.shape[0]
        # Heads first, then the split: views of the contiguous output, which a compiled
        # graph handles for any number of tokens (viewing a split's strided column range
        # made it specialize on a single token).
        q, k, v = (
            self.qkv_proj(x)
            .view(num_tokens, -1, self.head_dim)
            .split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        )
        q, k = rotary(positions, q, k)
        assert self.kv_cache is not None, "bind_kv_cache() before running the model"
        # k and v stay strided views of the fused output: the cache write reads them so.
        out = self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, kernels: KernelSelection) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(
            config.hidden_size, [size, size], ["gate", "up"], bias, dtype, kernels
        )
        self.down_proj = Linear(size, config.hidden_size, bias, dtype, kernels)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x), self.kernels))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, backend: AttentionBackend, dtype: torch.dtype, kernels: KernelSelection
    ) -> None:
        super().__init__()
        hidden_size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype, kernels)
        self.self_attn = LlamaAttention(config, backend, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype, kernels)
        self.mlp = LlamaMLP(config, dtype, kernels)

    def forward(self, x, residual, positions, rotary, metadata):
        """(this layer's output, the residual stream before it): the stream's add is left to
        the next norm, which fuses it with the normalization."""
        if residual is None:
            x, residual = self.input_layernorm(x)[0], x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rotary, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        backend: AttentionBackend,
        dtype: torch.dtype,
        max_len: int,
        kernels: KernelSelection,
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_tokens.weight.weight_loader = default_weight_loader
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, dtype, kernels)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, kernels)
        self.rotary = RotaryEmbedding(_head_dim(config), max_len, rope_parameters(config), kernels)

    def forward(self, input_ids, positions, metadata: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary, metadata)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Serves LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM checkpoints.

    `kernels` (the engine's one `KernelSelection`) is handed to every layer at construction;
    `backend` must be the attention backend it names.
    """

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend,
        dtype: torch.dtype,
        max_len: int,
        kernels: KernelSelection = TORCH_KERNELS,
    ):
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.attention_backend = backend
        self.model = LlamaModel(config, backend, dtype, max_len, kernels)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, kernels)
        if self.tie_word_embeddings:
            # One parameter under two names: the head is a plain Linear to everything that
            # walks Linear modules (oneDNN packing, int8 and gguf layers), and the checkpoint
            # fills it through the embedding (named_parameters lists it once, there).
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # A Linear (tied: on the embedding's weight), or its int8 or gguf replacement.
        return self.lm_head(hidden_states)

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            layer.self_attn.kv_cache = kv_cache

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the fused parameters; all must be filled."""
        params = dict(self.named_parameters())
        unloaded = set(params)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (
                name == "lm_head.weight" and self.tie_word_embeddings
            ):
                continue
            param_name, shard_id = _fused_name(name)
            if param_name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            param = params[param_name]
            tensor = tensor.to(param.dtype)
            if shard_id is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
            unloaded.discard(param_name)
        if unloaded:
            raise ValueError(f"checkpoint is missing weights for: {sorted(unloaded)[:8]}")


def _fused_name(name: str) -> tuple[str, str | None]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED_SHARDS:
            fused, shard_id = _FUSED_SHARDS[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard_id
    return name, None
