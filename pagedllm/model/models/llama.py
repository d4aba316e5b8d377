"""Llama-family decoder: Llama 2/3 and SmolLM2, Mistral (sliding window), Qwen2 (q/k/v bias),
Qwen3 (per-head q/k RMSNorm); other decoders (MoE, Phi-3) build on its layers.

Tensor parallel (the TP group of `get_tp_group()`): q/k/v and gate/up are column-parallel,
o and down row-parallel (one all-reduce each), the embedding and head vocabulary-parallel;
each rank holds `num_heads / tp` heads and `max(1, num_kv_heads / tp)` KV heads. Pipeline
parallel (`get_pp_group()`): the stage builds and loads only its layers
(`pipeline_stage_layers`); the first stage embeds, the others start from the previous
stage's `IntermediateTensors`, which every stage but the last returns. With nothing
initialized both groups have one rank and the model is the single-process one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_pp_group
from pagedllm.model.hidden_tap import HiddenStateTap
from pagedllm.model.layers.attention import Attention, bind_kv_caches, layer_sliding_windows
from pagedllm.model.layers.linear import Linear
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.model.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.model.layers.vocab_parallel import VocabParallelEmbedding, lm_head
from pagedllm.model.pipeline import IntermediateTensors, PPMissingLayer
from pagedllm.ops import fused
from pagedllm.ops.attention import AttentionBackend, AttentionMetadata
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection
from pagedllm.parallel_config import pipeline_stage_layers

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


# Architectures whose attention normalizes each query and key head (RMSNorm over head_dim)
# before RoPE.
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _architecture(config: Any) -> str:
    return (getattr(config, "architectures", None) or [""])[0]


def _biases(config: Any) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias): Qwen2 always biases q/k/v only; Llama follows attention_bias."""
    if _architecture(config) == "Qwen2ForCausalLM":
        return True, False
    attention_bias = bool(getattr(config, "attention_bias", False))
    return attention_bias, attention_bias


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_index: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        kernels: KernelSelection,
    ) -> None:
        super().__init__()
        total_num_heads = config.num_attention_heads
        self.head_dim = _head_dim(config)
        qkv_bias, o_bias = _biases(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            total_num_heads,
            _num_kv_heads(config),
            qkv_bias,
            dtype,
            kernels,
        )
        # This rank's heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_num_heads * self.head_dim, config.hidden_size, o_bias, dtype, kernels
        )
        self.q_norm = self.k_norm = None
        if _architecture(config) in _QK_NORM_ARCHITECTURES:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, kernels)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, kernels)
        window = layer_sliding_windows(config)[layer_index]
        self.attn = Attention(backend, self.head_dim**-0.5, window)

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
        if self.q_norm is not None:
            # The norms read the strided head ranges as they lie and write them contiguous:
            # reshaping them first made a compiled graph specialize on a single token.
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        q, k = rotary(positions, q, k)
        # k and v stay strided views of the fused output: the cache write reads them so.
        out = self.attn(q, k, v, metadata)
        return self.o_proj(out.reshape(num_tokens, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, kernels: KernelSelection) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], ["gate", "up"], bias, dtype, kernels
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, dtype, kernels)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x), self.kernels))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_index: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        kernels: KernelSelection,
    ) -> None:
        super().__init__()
        hidden_size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype, kernels)
        self.self_attn = LlamaAttention(config, layer_index, backend, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype, kernels)
        self.mlp = self.make_mlp(config, layer_index, dtype, kernels)

    def make_mlp(
        self, config: Any, layer_index: int, dtype: torch.dtype, kernels: KernelSelection
    ) -> nn.Module:
        """The feed-forward block of layer `layer_index` (a mixture of experts overrides it)."""
        return LlamaMLP(config, dtype, kernels)

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
    """The decoder stack of one pipeline stage. A subclass changes its norms, RoPE and
    embedding through `make_norm`, `make_rotary`, `rotary_for` and `embed`."""

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend,
        dtype: torch.dtype,
        max_len: int,
        kernels: KernelSelection,
        layer_class: type[nn.Module] = LlamaDecoderLayer,
    ):
        super().__init__()
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.stage_layers = pipeline_stage_layers(
            config.num_hidden_layers, pp.world_size, pp.rank_in_group
        )
        self.pipelined = pp.world_size > 1
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            layer_class(config, i, backend, dtype, kernels)
            if i in self.stage_layers
            else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm: nn.Module | None = None
        if self.is_last_stage:
            self.norm = self.make_norm(config, dtype, kernels)
        self.rotary = self.make_rotary(config, max_len, kernels)
        # Layers whose residual stream a speculative head reads (None: no reader).
        self.hidden_tap: HiddenStateTap | None = None

    def make_norm(self, config: Any, dtype: torch.dtype, kernels: KernelSelection) -> nn.Module:
        """The final norm."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, kernels)

    def make_rotary(self, config: Any, max_len: int, kernels: KernelSelection) -> nn.Module:
        """The RoPE the stage's layers take (`rotary_for` picks a layer's)."""
        return RotaryEmbedding(_head_dim(config), max_len, rope_parameters(config), kernels)

    def rotary_for(self, layer: nn.Module) -> nn.Module:
        return self.rotary

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def _tapped_layers(self, layers, x, residual, positions, metadata):
        """The layer loop, the stream kept at the tap's layers (a speculative head reads
        them; see hidden_tap.py)."""
        tap = self.hidden_tap
        assert tap is not None
        tap.clear()  # what a forward nobody read (one that raised, say) left behind
        first = self.stage_layers.start if self.pipelined else 0
        for index, layer in enumerate(layers, start=first):
            if index in tap.layers:
                tap.keep(x, residual)
            x, residual = layer(x, residual, positions, self.rotary_for(layer), metadata)
        if first + len(layers) in tap.layers:
            tap.keep(x, residual)
        return x, residual

    def own_layers(self) -> list[nn.Module]:
        """This stage's decoder layers, in order."""
        return [self.layers[i] for i in self.stage_layers]

    def forward(
        self,
        input_ids,
        positions,
        metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.is_first_stage:
            x, residual = self.embed(input_ids), None
        else:
            assert intermediate_tensors is not None, "a later stage starts from the previous one"
            x, residual = intermediate_tensors  # IntermediateTensors or a plain pair
        layers = self.layers
        if self.pipelined:  # one stage: the plain loop, as the compiled decode step traces it
            layers = self.layers[self.stage_layers.start : self.stage_layers.stop]
        if self.hidden_tap is None:
            for layer in layers:
                x, residual = layer(x, residual, positions, self.rotary_for(layer), metadata)
        else:
            x, residual = self._tapped_layers(layers, x, residual, positions, metadata)
        if not self.is_last_stage:
            return IntermediateTensors(x, residual)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Serves LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM
    checkpoints.

    `kernels` (the engine's one `KernelSelection`) is handed to every layer at construction;
    `backend` must be the attention backend it names.
    """

    # The decoder layer a subclass's architecture builds (an MoE layer, say).
    layer_class: type[nn.Module] = LlamaDecoderLayer
    # The stack it builds them in (Gemma 3's scales its embedding and keeps a RoPE per
    # attention kind).
    model_class: type[LlamaModel] = LlamaModel

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Refuse, before anything is built, a config this architecture cannot serve exactly
        (ValueError naming what is supported)."""

    def __init__(
        self,
        config: Any,
        backend: AttentionBackend,
        dtype: torch.dtype,
        max_len: int,
        kernels: KernelSelection = TORCH_KERNELS,
    ):
        super().__init__()
        self.check_config(config)
        self.config = config
        self.kernels = kernels
        self.attention_backend = backend
        self.model = self.model_class(config, backend, dtype, max_len, kernels, self.layer_class)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head: Linear | None = None  # a ParallelLMHead with several TP ranks
        if self.model.is_last_stage:
            self.lm_head = lm_head(config.vocab_size, config.hidden_size, dtype, kernels)
            if self.tie_word_embeddings and self.model.embed_tokens is not None:
                # One parameter under two names: the head is a plain Linear to everything
                # that walks Linear modules (oneDNN packing, int8 and gguf layers), and the
                # checkpoint fills it through the embedding (named_parameters lists it once,
                # there). A last stage without the embedding loads its own copy.
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids,
        positions,
        metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """The last stage's normed hidden states; another stage's `IntermediateTensors`."""
        return self.model(input_ids, positions, metadata, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab_size] logits on the TP group's rank 0 of the last stage; None on the
        other TP ranks (they must still call it, with the same rows: it gathers)."""
        # A ParallelLMHead (tied: on the embedding's weight), or its int8 or gguf replacement.
        assert self.lm_head is not None, "logits are computed on the last pipeline stage"
        return self.lm_head(hidden_states)

    def bind_kv_cache(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_groups: list[int] | None = None,
    ) -> None:
        """One (K, V) pair (and KV cache group) per layer of this stage, in layer order."""
        layers = [layer.self_attn.attn for layer in self.model.own_layers()]
        bind_kv_caches(layers, kv_caches, kv_groups)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the fused parameters; all must be filled."""
        params = dict(self.named_parameters())
        unloaded = set(params)
        own_tied_head = (
            self.tie_word_embeddings
            and self.lm_head is not None
            and self.model.embed_tokens is None
        )
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (
                name == "lm_head.weight" and self.tie_word_embeddings
            ):
                continue
            if own_tied_head and name == "model.embed_tokens.weight":
                name = "lm_head.weight"
            param_name, shard_id = self.checkpoint_target(name)
            if param_name not in params:
                if self.on_other_stage(param_name):
                    continue
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            param = params[param_name]
            if not isinstance(tensor, torch.Tensor) and not getattr(param, "narrows", False):
                tensor = tensor.materialize()  # a lazy checkpoint slice, for a whole-tensor loader
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to(param.dtype)
            # (A lazy slice is narrowed by the loader; copy_ converts the dtype of the piece.)
            load_param(param, tensor, shard_id)
            unloaded.discard(param_name)
        if unloaded:
            raise ValueError(f"checkpoint is missing weights for: {sorted(unloaded)[:8]}")

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        """(parameter name, shard id or None) that checkpoint tensor `name` loads into. A
        subclass maps its own names first (an MoE's per-expert tensors, whose gate_proj and
        up_proj are no dense gate/up shards)."""
        return fused_param_name(name)

    def on_other_stage(self, param_name: str) -> bool:
        """A parameter another pipeline stage holds (this one skips it)."""
        if not self.model.pipelined:
            return False
        parts = param_name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
            return int(parts[2]) not in self.model.stage_layers
        return parts[:2] in (["model", "embed_tokens"], ["model", "norm"]) or parts[0] == "lm_head"


def load_param(param: nn.Parameter, tensor: Any, shard_id: str | None) -> None:
    """Hand `tensor` to the parameter's own loader: whole, or as shard `shard_id` of a
    fused parameter (fused_param_name's)."""
    if shard_id is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard_id)


def fused_param_name(name: str) -> tuple[str, str | None]:
    """(parameter name, shard id or None) of checkpoint tensor `name`: q/k/v and gate/up
    projections load into their fused parameters."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED_SHARDS:
            fused, shard_id = _FUSED_SHARDS[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard_id
    return name, None
