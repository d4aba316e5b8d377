"""Paged attention's interface: the step's common layout, and what every backend implements.

The model runner describes a step once, as numpy arrays (`AttentionLayout`); the backend in
use turns that into its own metadata (`AttentionBackend.build_metadata`, vLLM's "metadata
builder"), building only what its `forward` reads. Every backend writes the step's new keys
and values into the paged cache by slot mapping, then reads each request's context through
its block table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.ops.kv_quant import KVCache, is_quantized, quantize, storage_view


@dataclass(frozen=True)
class AttentionLayout:
    """One forward pass's flattened batch, as the runner builds it (numpy, on the host).

    Requests are laid out back to back: request i owns tokens
    `query_start_loc[i]:query_start_loc[i + 1]`, which sit at positions
    `seq_lens[i] - query_len .. seq_lens[i] - 1` of its sequence.
    """

    slot_mapping: np.ndarray  # [num_tokens] cache slot (block_id * block_size + offset)
    # [num_reqs, max_num_blocks]: the blocks the longest context needs, padded with the
    # null block 0
    block_tables: np.ndarray
    query_start_loc: np.ndarray  # [num_reqs + 1]
    seq_lens: np.ndarray  # [num_reqs] context length once this step's tokens are in

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


@dataclass
class AttentionMetadata:
    """What every backend's metadata holds; each backend subclasses it with its own fields."""

    slot_mapping: torch.Tensor  # [num_tokens] int64


class AttentionBackend(ABC):
    """Computes attention for the flattened batch; q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""

    name: str
    # Whether its metadata holds only tensors, so that a compiled forward (torch.compile)
    # does not specialize on the step's layout and recompile step after step.
    traceable: bool = False

    @abstractmethod
    def build_metadata(self, layout: AttentionLayout, device: torch.device) -> AttentionMetadata:
        """This backend's metadata for a step, with tensors on `device`."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """With `sliding_window` W a query at position i sees keys i - W + 1 .. i (as
        Transformers' sliding-window mask): blocks wholly before that may be the null block."""


def to_device(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None):
    """`array` as a tensor on `device` (in `dtype` if given); no copy on the CPU when it
    already is contiguous in that dtype."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.to(device=device, dtype=dtype or tensor.dtype)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slots: torch.Tensor
) -> None:
    """Store the step's keys and values at their slots (caches: [blocks, block_size, Hkv, D];
    a quantized cache's rows quantized, their scales beside them: `ops/kv_quant.py`)."""
    key_cache = kv_cache[0]
    if not is_quantized(key_cache.dtype):
        for cache, x in zip(kv_cache, (k, v), strict=True):
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))
        return
    for cache, scales, x in ((kv_cache[0], kv_cache[2], k), (kv_cache[1], kv_cache[3], v)):
        values, scale = quantize(x, cache.dtype)
        rows = storage_view(cache).view(-1, *cache.shape[2:])
        rows.index_copy_(0, slots, storage_view(values))
        scales.view(-1, scales.shape[-1]).index_copy_(0, slots, scale)
