"""The EAGLE-3 head as a plain torch module for training, computing what the engine's
`Eagle3Head` (spec_decode/runner/eagle_head.py) computes, with its tensors named as
the published layout names them (export.py) and the target's embedding frozen beside it.

Training-time test: step 0 reads the target's states at every position p (with the token at
p + 1, predicting p + 2); step j reads the chain state step j - 1 left at p - 1, and attends
to what the engine's chained drafts see: step 0's keys up to p - j (the catch-up over the
verified tokens) and, of each step i = 1 .. j, the key at p - j + i (the chain's own)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HeadSizes:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_target_states: int
    draft_vocab: int
    rms_norm_eps: float
    rope_theta: float


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def ttt_mask(num_positions: int, step: int) -> torch.Tensor:
    """[T, (step + 1) T]: which keys (step 0's, then each later step's) a query of `step`
    at position p attends to."""
    p = torch.arange(num_positions)[:, None]
    c = torch.arange(num_positions)[None, :]
    blocks = [c <= p - step] + [c == p - step + i for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


class TrainableEagle3Head(nn.Module):
    def __init__(self, sizes: HeadSizes, target_embedding: torch.Tensor) -> None:
        super().__init__()
        self.sizes = sizes
        h, eps = sizes.hidden, sizes.rms_norm_eps
        q_size, kv_size = sizes.num_heads * sizes.head_dim, sizes.num_kv_heads * sizes.head_dim
        self.fc = nn.Linear(sizes.num_target_states * h, h, bias=False)
        self.input_layernorm = _RMSNorm(h, eps)
        self.hidden_norm = _RMSNorm(h, eps)
        self.q_proj = nn.Linear(2 * h, q_size, bias=False)
        self.k_proj = nn.Linear(2 * h, kv_size, bias=False)
        self.v_proj = nn.Linear(2 * h, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, h, bias=False)
        self.post_attention_layernorm = _RMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, sizes.intermediate, bias=False)
        self.up_proj = nn.Linear(h, sizes.intermediate, bias=False)
        self.down_proj = nn.Linear(sizes.intermediate, h, bias=False)
        self.norm = _RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, sizes.draft_vocab, bias=False)
        self.register_buffer("embedding", target_embedding.float(), persistent=False)
        inv_freq = 1.0 / sizes.rope_theta ** (
            torch.arange(0, sizes.head_dim, 2, dtype=torch.float32) / sizes.head_dim
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj):
            nn.init.normal_(linear.weight, std=0.02)
        for linear in (self.up_proj, self.down_proj):
            nn.init.normal_(linear.weight, std=0.02)

    def init_from_target(
        self, lm_head_rows: torch.Tensor, final_norm: torch.Tensor, last_state: int
    ) -> None:
        """Start from the target's output side: its lm_head over the draft vocabulary, its
        final norm, and `fc` passing the highest tapped layer through."""
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_rows)
            self.norm.weight.copy_(final_norm)
            h = self.sizes.hidden
            # The highest layer passed through, damped: the head starts near the target's
            # guess of the token it already reads, not confident in it.
            self.fc.weight.normal_(std=0.02)
            self.fc.weight[:, last_state * h : (last_state + 1) * h] += 0.1 * torch.eye(h)

    def rope(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, count, self.sizes.head_dim).transpose(1, 2)

    def step(self, token_ids, hidden, rope, past_keys, past_values, step_index):
        """One training-time-test step over [B, T] positions: (the final norm's output, the
        chain state), step_index's keys/values appended to the pasts."""
        s = self.sizes
        embeds = self.input_layernorm(F.embedding(token_ids, self.embedding))
        both = torch.cat([embeds, self.hidden_norm(hidden)], dim=-1)
        cos, sin = rope
        q = _rotate(self._heads(self.q_proj(both), s.num_heads), cos, sin)
        past_keys.append(_rotate(self._heads(self.k_proj(both), s.num_kv_heads), cos, sin))
        past_values.append(self._heads(self.v_proj(both), s.num_kv_heads))
        keys, values = torch.cat(past_keys, dim=2), torch.cat(past_values, dim=2)
        mask = ttt_mask(token_ids.shape[1], step_index)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        attn = attn.transpose(1, 2).reshape(*token_ids.shape, -1)
        residual = self.o_proj(attn) + hidden  # norm_before_residual: false
        x = self.post_attention_layernorm(residual)
        chain = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) + residual
        return self.norm(chain), chain

    def forward(self, token_ids, target_states, num_steps: int) -> list[torch.Tensor]:
        """Each step's normed output [B, T, hidden] (`lm_head` makes logits of the
        positions that are scored: most of a prompt is not)."""
        rope = self.rope(token_ids.shape[1])
        hidden = self.fc(target_states)
        past_keys: list[torch.Tensor] = []
        past_values: list[torch.Tensor] = []
        logits = []
        for step_index in range(num_steps):
            step_logits, chain = self.step(
                token_ids, hidden, rope, past_keys, past_values, step_index
            )
            logits.append(step_logits)
            hidden = F.pad(chain[:, :-1], (0, 0, 1, 0))  # position p reads the chain of p - 1
        return logits

    def published_tensors(self) -> dict[str, torch.Tensor]:
        """The head's weights under the EAGLE-3 layout's names (no embedding: the target's)."""
        tensors = self.published_parameters()
        return {name: t.detach().float().contiguous() for name, t in tensors.items()}

    def published_parameters(self) -> dict[str, nn.Parameter]:
        """The head's parameters by their names in the EAGLE-3 layout."""
        layer = {
            "input_layernorm": self.input_layernorm,
            "hidden_norm": self.hidden_norm,
            "self_attn.q_proj": self.q_proj,
            "self_attn.k_proj": self.k_proj,
            "self_attn.v_proj": self.v_proj,
            "self_attn.o_proj": self.o_proj,
            "post_attention_layernorm": self.post_attention_layernorm,
            "mlp.gate_proj": self.gate_proj,
            "mlp.up_proj": self.up_proj,
            "mlp.down_proj": self.down_proj,
        }
        tensors = {f"midlayer.{name}.weight": m.weight for name, m in layer.items()}
        tensors.update(
            {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight},
            **{"lm_head.weight": self.lm_head.weight},
        )
        return tensors
