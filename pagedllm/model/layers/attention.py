"""One decoder layer's paged attention as the models see it: its KV cache, its KV cache group
and its sliding window, in front of the engine's attention backend.

A model with layers of different attention kinds (Gemma 3's local and global layers) keeps
one block table per KV cache group (`core/kv_cache_spec.py`); the runner then hands the
model one metadata per group, and each layer picks its own group's. A model with one group
gets a single metadata, which every layer uses as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pagedllm.ops.attention import AttentionBackend, AttentionMetadata
from pagedllm.ops.kv_quant import KVCache


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Each decoder layer's sliding window in tokens (None: full attention), as Transformers
    reads the config: `layer_types` where the config has it (Gemma 3, Qwen2/3), else the one
    `sliding_window` for every layer (Mistral, Mixtral, Phi-3), unless `use_sliding_window`
    is off."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(
                f"layer types {sorted(unknown)} are not supported; supported: "
                "full_attention, sliding_attention"
            )
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if not getattr(config, "use_sliding_window", True):
        window = None
    return [window] * num_layers


class Attention(nn.Module):
    """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D] through the backend, on this layer's cache."""

    def __init__(
        self, backend: AttentionBackend, scale: float, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.backend = backend
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_cache: KVCache | None = None  # (K, V), with scales if 8-bit
        self.kv_group = 0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata | Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        assert self.kv_cache is not None, "bind_kv_cache() before running the model"
        if not isinstance(metadata, AttentionMetadata):
            metadata = metadata[self.kv_group]
        return self.backend.forward(
            q, k, v, self.kv_cache, metadata, self.scale, self.sliding_window
        )


def bind_kv_caches(
    layers: Sequence[Attention],
    kv_caches: Sequence[KVCache],
    kv_groups: Sequence[int] | None = None,
) -> None:
    """Give each attention layer (in layer order) its KV cache entry ((K, V), or (K, V,
    K scale, V scale) when 8-bit: `ops/kv_quant.py`) and its KV cache group."""
    groups = kv_groups if kv_groups is not None else [0] * len(layers)
    for layer, kv_cache, group in zip(layers, kv_caches, groups, strict=True):
        layer.kv_cache = kv_cache
        layer.kv_group = group
