"""Paged attention: the per-step metadata and the backends that implement it, chosen by name.

Every backend writes the step's new keys and values into the paged cache by slot
mapping, then reads each request's context through its block table.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """One forward pass's layout of the flattened batch (built once, shared by all layers).

    Requests are laid out back to back: request i owns tokens
    `query_start_loc[i]:query_start_loc[i + 1]`, which sit at positions
    `seq_lens[i] - query_len .. seq_lens[i] - 1` of its sequence.
    """

    slot_mapping: torch.Tensor  # [num_tokens] cache slot (block_id * block_size + offset)
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks], padded with the null block 0
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs] context length once this step's tokens are in
    # Requests with a single query token, batched together in one padded call.
    decode_req_indices: torch.Tensor  # [num_decodes]
    decode_token_indices: torch.Tensor  # [num_decodes]
    decode_seq_lens: torch.Tensor  # [num_decodes]
    prefill_req_indices: list[int]
    # The layout as the CPU kernel takes it (int32 tensors), built once for all layers. The
    # kernel path reads only tensors, so a compiled forward does not specialize on the lists.
    kernel_block_tables: torch.Tensor = field(init=False)
    kernel_query_start_loc: torch.Tensor = field(init=False)
    kernel_seq_lens: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        tables = self.block_tables.to(torch.int32)
        if tables.shape[1] < 2:
            # At least two columns (the null block pads): torch.compile specializes a size
            # of 1 and would compile another graph for the steps whose contexts fit a block.
            tables = F.pad(tables, (0, 2 - tables.shape[1]))
        self.kernel_block_tables = tables.contiguous()
        self.kernel_query_start_loc = torch.tensor(self.query_start_loc, dtype=torch.int32)
        self.kernel_seq_lens = torch.tensor(self.seq_lens, dtype=torch.int32)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


class AttentionBackend(ABC):
    """Computes attention for the flattened batch; q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""

    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
) -> None:
    """Store the step's keys and values at their slots (caches: [blocks, block_size, Hkv, D])."""
    key_cache, value_cache = kv_cache
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, k.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, v.to(value_cache.dtype))


class TorchAttentionBackend(AttentionBackend):
    """Reference implementation on `scaled_dot_product_attention`.

    Decodes (one query token) are gathered into one padded batch; each prefill chunk runs
    on its own with a causal mask offset by the tokens already in the cache.
    """

    name = "torch"

    def forward(self, q, k, v, kv_cache, metadata, scale):
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        if len(metadata.decode_req_indices):
            out[metadata.decode_token_indices] = self._decode(q, kv_cache, metadata, scale)
        for req_index in metadata.prefill_req_indices:
            start = metadata.query_start_loc[req_index]
            end = metadata.query_start_loc[req_index + 1]
            out[start:end] = self._prefill(q[start:end], kv_cache, metadata, req_index, scale)
        return out

    def __init__(self) -> None:
        # Gather buffers reused across layers and steps: a fresh multi-MB tensor per layer
        # costs more in page faults than the copy itself.
        self._workspace: dict[str, torch.Tensor] = {}

    def _gather(
        self, cache: torch.Tensor, block_ids: torch.Tensor, name: str, dtype: torch.dtype
    ) -> torch.Tensor:
        """cache[block_ids] as [num_ids, block_size, Hkv, D] in `dtype`, via a reused buffer."""
        shape = (block_ids.numel(), *cache.shape[1:])
        buffer = self._workspace.get(name)
        numel = math.prod(shape)
        if buffer is None or buffer.numel() < numel or buffer.dtype != cache.dtype:
            buffer = torch.empty(numel, dtype=cache.dtype, device=cache.device)
            self._workspace[name] = buffer
        out = torch.index_select(cache, 0, block_ids, out=buffer[:numel].view(shape))
        # A 16-bit cache (kv_cache_dtype) under a float32 model computes in float32.
        return out if out.dtype == dtype else out.to(dtype)

    def _decode(self, q, kv_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        block_size = key_cache.shape[1]
        max_len = int(metadata.decode_seq_lens.max())
        num_blocks = -(-max_len // block_size)
        tables = metadata.block_tables[metadata.decode_req_indices, :num_blocks].reshape(-1)
        batch = len(metadata.decode_req_indices)
        # [B, Hkv, L, D] views of the gathered blocks
        keys = self._gather(key_cache, tables, "k", q.dtype).view(batch, -1, *key_cache.shape[2:])
        values = self._gather(value_cache, tables, "v", q.dtype).view(
            batch, -1, *value_cache.shape[2:]
        )
        positions = torch.arange(keys.shape[1], device=q.device)
        mask = (positions[None, :] < metadata.decode_seq_lens[:, None])[:, None, None, :]
        query = q[metadata.decode_token_indices].unsqueeze(2)  # [B, H, 1, D]
        out = F.scaled_dot_product_attention(
            query,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    def _prefill(self, q, kv_cache, metadata: AttentionMetadata, req_index: int, scale: float):
        key_cache, value_cache = kv_cache
        block_size = key_cache.shape[1]
        seq_len = metadata.seq_lens[req_index]
        table = metadata.block_tables[req_index, : -(-seq_len // block_size)]
        keys = self._gather(key_cache, table, "k", q.dtype).flatten(0, 1)[:seq_len].transpose(0, 1)
        values = (
            self._gather(value_cache, table, "v", q.dtype).flatten(0, 1)[:seq_len].transpose(0, 1)
        )
        query = q.transpose(0, 1)  # [H, n, D]
        num_queries = q.shape[0]
        context_start = seq_len - num_queries
        if context_start == 0:
            out = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            key_positions = torch.arange(seq_len, device=q.device)
            query_positions = torch.arange(context_start, seq_len, device=q.device)
            mask = key_positions[None, :] <= query_positions[:, None]
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return out.transpose(0, 1)


def _cpu_backend() -> AttentionBackend:
    # Imported on demand: the module compiles/loads a C++ extension and imports this one.
    from pagedllm.ops.cpu_attention import create_backend

    return create_backend()


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "cpu": _cpu_backend,
}


def check_attention_backend(name: str) -> None:
    """Refuse an unknown backend name without building the backend (the server's API
    process checks the configuration but never runs the model)."""
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend {name!r} is unknown; choose one of {sorted(_BACKENDS)}"
        )


def get_attention_backend(name: str) -> AttentionBackend:
    check_attention_backend(name)
    return _BACKENDS[name]()
