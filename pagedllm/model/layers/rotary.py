"""Rotary position embeddings (rotate-half layout): default, linear, llama3 and LongRoPE
(`longrope`, legacy name `su`) frequencies, over all of a head or its first
`partial_rotary_factor` share of dimensions.

LongRoPE (Phi-3, Phi-3.5, Phi-4-mini) divides each frequency by its own factor, taken from
`short_factor` or `long_factor`, and scales cos and sin by an attention factor (given, or
sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), where `factor` defaults to
max_position_embeddings / original_max_position_embeddings).

Which factors apply is decided once per engine: the long ones iff `max_position` (the
engine's max_model_len) exceeds `original_max_position_embeddings`. Transformers decides
per forward call, on that call's longest position, which a batching engine cannot follow:
the choice would depend on which requests share a step, and a request's cached keys would
mix the two sets. The engine-wide rule gives Transformers' output whenever every forward
Transformers makes lies on the same side of the threshold: always when max_model_len is at
most the original context, and, above it, for prompts longer than the original context.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from pagedllm.ops import fused
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
logger = logging.getLogger(__name__)

# Older names Transformers still reads: the first Phi-3 checkpoints call LongRoPE "su".
_ROPE_TYPE_ALIASES = {"su": "longrope"}


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """rope_type/rope_theta/scaling from either the current or the legacy config fields."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    params = {**legacy, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    if params["rope_type"] == "longrope":
        _complete_longrope(params, hf_config)
    return params


def _complete_longrope(params: dict[str, Any], hf_config: Any) -> None:
    """Fill the defaults Transformers derives from the config's context lengths."""
    max_positions = hf_config.max_position_embeddings
    # Phi-3 keeps the pre-training context beside the rope dict; Transformers prefers it there.
    original = (
        getattr(hf_config, "original_max_position_embeddings", None)
        or params.get("original_max_position_embeddings")
        or max_positions
    )
    params["original_max_position_embeddings"] = original
    if params.get("factor") is None:
        params["factor"] = max_positions / original


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    """How many leading dimensions of each head rotate (the rest pass through)."""
    factor = params.get("partial_rotary_factor", 1.0)
    dim = int(head_dim * factor)
    if not 0 < factor <= 1 or dim < 2 or dim % 2:
        raise ValueError(
            f"partial_rotary_factor {factor} rotates {dim} of {head_dim} dimensions; "
            "supported: a factor in (0, 1] that rotates an even number of dimensions"
        )
    return dim


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def uses_long_factors(params: dict[str, Any], max_position: int) -> bool:
    """LongRoPE's engine-wide choice (see the module docstring)."""
    return max_position > params["original_max_position_embeddings"]


def _longrope_factors(params: dict[str, Any], dim: int, max_position: int) -> torch.Tensor:
    """The per-frequency divisors of `dim` rotated dimensions (both sets are checked)."""
    num_frequencies = dim // 2
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if not isinstance(factors, list | tuple) or len(factors) != num_frequencies:
            raise ValueError(
                f"longrope {key} must list {num_frequencies} factors (one per frequency of "
                f"{dim} rotated dimensions); got {str(factors)[:60]}"
            )
    key = "long_factor" if uses_long_factors(params, max_position) else "short_factor"
    return torch.tensor(params[key], dtype=torch.float32)


def _log_longrope_choice(params: dict[str, Any], max_position: int) -> None:
    original = params["original_max_position_embeddings"]
    if uses_long_factors(params, max_position):
        logger.info(
            "LongRoPE: long factors for every request (max_model_len %d > original context "
            "%d); Transformers would use the short ones for sequences within %d tokens",
            max_position,
            original,
            original,
        )
    else:
        logger.info("LongRoPE: short factors (max_model_len %d <= %d)", max_position, original)


def compute_inv_freq(dim: int, params: dict[str, Any], max_position: int) -> torch.Tensor:
    """The `dim / 2` inverse frequencies of `dim` rotated dimensions, for an engine whose
    positions stay below `max_position`."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    if rope_type == "longrope":
        factors = _longrope_factors(params, dim, max_position)
        return 1.0 / (factors * params["rope_theta"] ** exponents)
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    return inv_freq


def attention_factor(params: dict[str, Any]) -> float:
    """The scale of cos and sin: LongRoPE's (given or from its context growth), else 1."""
    if params["rope_type"] != "longrope":
        return 1.0
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    factor = params["factor"]
    if factor <= 1.0:
        return 1.0
    original = params["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flattened q [T, H, D] and k [T, Hkv, D] at the given positions."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        kernels: KernelSelection = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim(head_dim, params)
        inv_freq = compute_inv_freq(self.rotary_dim, params, max_position)
        if params["rope_type"] == "longrope":
            _log_longrope_choice(params, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(params)
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)
        self.kernels = kernels

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self.rotary_dim
        if dim == q.shape[-1]:
            return fused.rotary_embedding(
                positions, q, k, self.cos_cache, self.sin_cache, self.kernels
            )
        # Partial rotation: the kernel takes the leading dimensions as views (unit stride in
        # D is all it needs); the rest of each head passes through.
        q_rot, k_rot = fused.rotary_embedding(
            positions, q[..., :dim], k[..., :dim], self.cos_cache, self.sin_cache, self.kernels
        )
        return torch.cat((q_rot, q[..., dim:]), dim=-1), torch.cat((k_rot, k[..., dim:]), dim=-1)
