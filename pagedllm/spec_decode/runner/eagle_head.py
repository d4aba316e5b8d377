"""The EAGLE heads as modules: `Eagle3Head` (EAGLE-3) and `EagleHead` (EAGLE-1/2), each a
Llama decoder layer (or a few) on the target's hidden states and its own token embeddings.

Both run over the same positions as the target: at position p the head reads the target's
hidden state at p and the token at p + 1, and its logits there propose the token at p + 2.
A chained step reads the head's own hidden state of the position before instead of the
target's. What the head returns for chaining is `chain`, for logits `for_logits`.

- EAGLE-3: `fc` maps the target's three tapped layers (3 x target hidden) to the head's
  hidden size once (`project`); the first layer normalizes the embeddings and that hidden
  state apart (`input_layernorm`, `hidden_norm`) and attends over both side by side (its
  q/k/v take 2 x hidden); a final `norm` precedes its own `lm_head` over a draft vocabulary
  whose token ids map to the target's through `d2t` (target id = draft id + d2t[draft id]).
- EAGLE: `fc` maps [embedding, hidden] (2 x hidden) to hidden before the first layer, which
  has no input norm; its un-normed output goes through the target's `lm_head` (it was
  trained to predict the target's normed hidden state).

Embeddings (and EAGLE's lm_head) the checkpoint does not hold are the target's, shared, not
copied; they are kept outside the module tree so that nothing packs or loads them twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.attention import bind_kv_caches
from pagedllm.model.layers.linear import Linear
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.parallel_linear import QKVParallelLinear
from pagedllm.model.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.model.layers.vocab_parallel import VocabParallelEmbedding
from pagedllm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from pagedllm.ops.kernel_selection import KernelSelection


@dataclass
class TargetParts:
    """What a head may share with its target: the embedding and the logits head (whole on
    the sampling rank: the target's own, or copies under tensor parallelism)."""

    embed_tokens: nn.Module | None  # None on a pipeline stage without it (Medusa's)
    compute_logits: Any  # hidden -> [rows, vocabulary] logits


class _Eagle3FirstLayer(nn.Module):
    """EAGLE-3's first layer: attention over [norm(embedding), norm(hidden)]."""

    def __init__(self, config: Any, backend, dtype: torch.dtype, kernels: KernelSelection):
        super().__init__()
        hidden_size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype, kernels)
        self.hidden_norm = RMSNorm(hidden_size, eps, dtype, kernels)
        self.self_attn = LlamaAttention(config, 0, backend, dtype, kernels)
        attn = self.self_attn
        # The embeddings and the hidden state side by side: q/k/v read twice the width.
        attn.qkv_proj = QKVParallelLinear(
            2 * hidden_size,
            attn.head_dim,
            config.num_attention_heads,
            attn.num_kv_heads,
            bool(getattr(config, "attention_bias", False)),
            dtype,
            kernels,
        )
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype, kernels)
        self.mlp = LlamaMLP(config, dtype, kernels)
        # Checkpoints differ in whether the residual stream starts before or after the norm.
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds, hidden, positions, rotary, metadata):
        embeds = self.input_layernorm(embeds)[0]
        normed = self.hidden_norm(hidden)[0]
        residual = normed if self.norm_before_residual else hidden
        x = self.self_attn(torch.cat([embeds, normed], dim=-1), positions, rotary, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class _EagleFirstLayer(LlamaDecoderLayer):
    """EAGLE's first layer: a Llama layer without its input norm (the fc output enters it
    as it is)."""

    def __init__(self, config: Any, backend, dtype: torch.dtype, kernels: KernelSelection):
        super().__init__(config, 0, backend, dtype, kernels)
        self.input_layernorm = None

    def forward(self, x, residual, positions, rotary, metadata):
        residual = x
        x = self.self_attn(x, positions, rotary, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class _HeadBase(nn.Module):
    """What both heads share: rotary, the layers after the first, the KV binding."""

    def __init__(self, config: Any, backend, dtype, max_len: int, kernels: KernelSelection):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.rotary = RotaryEmbedding(head_dim, max_len, rope_parameters(config), kernels)
        self.later_layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, dtype, kernels)
            for i in range(1, config.num_hidden_layers)
        )
        self.embed_tokens: VocabParallelEmbedding | None = None
        self._target: TargetParts | None = None

    def share_target(self, target: TargetParts) -> None:
        self._target = target

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        assert self._target is not None, "a head without embeddings shares its target's"
        assert self._target.embed_tokens is not None, "the target's embedding on this stage"
        return self._target.embed_tokens(input_ids)

    def attention_layers(self) -> list[nn.Module]:
        return [self.first_layer.self_attn.attn] + [
            layer.self_attn.attn for layer in self.later_layers
        ]

    def bind_kv_cache(self, kv_caches) -> None:
        bind_kv_caches(self.attention_layers(), kv_caches)

    def _run_later_layers(self, x, residual, positions, metadata):
        for layer in self.later_layers:
            x, residual = layer(x, residual, positions, self.rotary, metadata)
        return x, residual


class Eagle3Head(_HeadBase):
    def __init__(
        self,
        config: Any,
        backend,
        dtype: torch.dtype,
        max_len: int,
        kernels: KernelSelection,
        own_embeddings: bool,
        own_lm_head: bool,
        target_hidden_size: int,
        num_target_states: int,
    ) -> None:
        super().__init__(config, backend, dtype, max_len, kernels)
        hidden_size = config.hidden_size
        if own_embeddings:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden_size, dtype)
        self.fc = Linear(num_target_states * target_hidden_size, hidden_size, False, dtype, kernels)
        self.first_layer = _Eagle3FirstLayer(config, backend, dtype, kernels)
        self.norm = RMSNorm(hidden_size, config.rms_norm_eps, dtype, kernels)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        # Without one of its own, the target's (over the same vocabulary).
        self.lm_head: Linear | None = None
        if own_lm_head:
            self.lm_head = Linear(hidden_size, self.draft_vocab_size, False, dtype, kernels)
        elif self.draft_vocab_size != config.vocab_size:
            raise ValueError(
                f"speculative_config: the EAGLE-3 head has a draft vocabulary of "
                f"{self.draft_vocab_size} tokens but no lm_head of its own"
            )
        # Draft token id -> target token id offset (zeros: the same vocabulary).
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self._draft_to_target: torch.Tensor | None = None

    def project(self, target_states: torch.Tensor) -> torch.Tensor:
        """The target's tapped layers, side by side, to the head's hidden size."""
        return self.fc(target_states)

    def forward(self, input_ids, positions, hidden, metadata):
        """(for_logits, chain): the normed output, and the stream before that norm."""
        embeds = self.embed(input_ids)
        x, residual = self.first_layer(embeds, hidden, positions, self.rotary, metadata)
        x, residual = self._run_later_layers(x, residual, positions, metadata)
        return self.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, target vocabulary]: the draft vocabulary's logits at their target ids,
        -inf elsewhere (a draft never proposes a token outside it)."""
        if self.lm_head is None:
            assert self._target is not None, "a head without lm_head shares its target's"
            return self._target.compute_logits(hidden).float()
        logits = self.lm_head(hidden).float()
        if self.draft_vocab_size == self.vocab_size and not bool(self.d2t.any()):
            return logits
        if self._draft_to_target is None:
            self._draft_to_target = torch.arange(self.draft_vocab_size) + self.d2t
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self._draft_to_target] = logits
        return full


class EagleHead(_HeadBase):
    def __init__(
        self,
        config: Any,
        backend,
        dtype: torch.dtype,
        max_len: int,
        kernels: KernelSelection,
        fc_bias: bool,
    ) -> None:
        super().__init__(config, backend, dtype, max_len, kernels)
        hidden_size = config.hidden_size
        self.fc = Linear(2 * hidden_size, hidden_size, fc_bias, dtype, kernels)
        self.first_layer = _EagleFirstLayer(config, backend, dtype, kernels)

    def project(self, target_states: torch.Tensor) -> torch.Tensor:
        return target_states  # the target's normed output, as the head was trained on

    def forward(self, input_ids, positions, hidden, metadata):
        """(for_logits, chain): both the last layer's output with its residual add."""
        x = self.fc(torch.cat([self.embed(input_ids), hidden], dim=-1))
        x, residual = self.first_layer(x, None, positions, self.rotary, metadata)
        x, residual = self._run_later_layers(x, residual, positions, metadata)
        out = x + residual
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self._target is not None, "EAGLE's logits are its target's lm_head's"
        return self._target.compute_logits(hidden).float()
