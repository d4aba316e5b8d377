"""The "torch" attention backend: the reference on `scaled_dot_product_attention`, any device
and dtype, and its metadata (decodes gathered into one padded batch; prefills one by one)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.ops.attention import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadata,
    to_device,
    write_kv_cache,
)
from pagedllm.ops.kv_quant import KVCache, dequantize, is_quantized
from pagedllm.utils import cdiv


def cdiv_tensor(a: torch.Tensor, b: int) -> torch.Tensor:
    return (a + b - 1) // b


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks], padded with the null block 0
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]
    # Requests with a single query token, batched together in one padded call.
    decode_req_indices: torch.Tensor  # [num_decodes]
    decode_token_indices: torch.Tensor  # [num_decodes]
    decode_seq_lens: torch.Tensor  # [num_decodes]
    prefill_req_indices: list[int]


class TorchAttentionBackend(AttentionBackend):
    """Reference implementation on `scaled_dot_product_attention`.

    Decodes (one query token) are gathered into one padded batch; each prefill chunk runs
    on its own with a causal mask offset by the tokens already in the cache. Its metadata
    holds Python lists (the prefill loop's bounds), so it is not traceable.
    """

    name = "torch"
    traceable = False

    def __init__(self) -> None:
        # Gather buffers reused across layers and steps: a fresh multi-MB tensor per layer
        # costs more in page faults than the copy itself.
        self._workspace: dict[str, torch.Tensor] = {}

    def build_metadata(
        self, layout: AttentionLayout, device: torch.device
    ) -> TorchAttentionMetadata:
        query_start_loc, seq_lens = layout.query_start_loc, layout.seq_lens
        is_decode = np.diff(query_start_loc) == 1
        return TorchAttentionMetadata(
            slot_mapping=to_device(layout.slot_mapping, device, torch.int64),
            block_tables=to_device(layout.block_tables, device),
            query_start_loc=query_start_loc.tolist(),
            seq_lens=seq_lens.tolist(),
            decode_req_indices=to_device(np.flatnonzero(is_decode), device),
            decode_token_indices=to_device(query_start_loc[:-1][is_decode], device),
            decode_seq_lens=to_device(seq_lens[is_decode], device),
            prefill_req_indices=np.flatnonzero(~is_decode).tolist(),
        )

    def forward(
        self, q, k, v, kv_cache, metadata: TorchAttentionMetadata, scale, sliding_window=None
    ):
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        if len(metadata.decode_req_indices):
            out[metadata.decode_token_indices] = self._decode(
                q, kv_cache, metadata, scale, sliding_window
            )
        for req_index in metadata.prefill_req_indices:
            start = metadata.query_start_loc[req_index]
            end = metadata.query_start_loc[req_index + 1]
            out[start:end] = self._prefill(
                q[start:end], kv_cache, metadata, req_index, scale, sliding_window
            )
        return out

    def _gather(
        self, kv_cache: KVCache, index: int, block_ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """kv_cache[index][block_ids] (index 0: K, 1: V) as [num_ids, block_size, Hkv, D] in
        `dtype`, via a reused buffer; a quantized cache's gathered blocks (only those)
        dequantized by their scales."""
        cache, name = kv_cache[index], "kv"[index]
        shape = (block_ids.numel(), *cache.shape[1:])
        buffer = self._workspace.get(name)
        numel = math.prod(shape)
        if buffer is None or buffer.numel() < numel or buffer.dtype != cache.dtype:
            buffer = torch.empty(numel, dtype=cache.dtype, device=cache.device)
            self._workspace[name] = buffer
        out = torch.index_select(cache, 0, block_ids, out=buffer[:numel].view(shape))
        if is_quantized(cache.dtype):
            return dequantize(out, kv_cache[2 + index].index_select(0, block_ids), dtype)
        # A 16-bit cache (kv_cache_dtype) under a float32 model computes in float32.
        return out if out.dtype == dtype else out.to(dtype)

    def _decode(self, q, kv_cache, metadata: TorchAttentionMetadata, scale: float, window):
        key_cache, value_cache = kv_cache[:2]
        block_size = key_cache.shape[1]
        seq_lens = metadata.decode_seq_lens.long()
        tables = metadata.block_tables[metadata.decode_req_indices]
        # Blocks read from each request's first block in its window on (all of them with no
        # window): a block wholly outside it may be the null block, whose contents are not
        # keys and must not reach the softmax (0 x NaN is NaN).
        first_block = torch.zeros_like(seq_lens)
        if window is not None:
            first_block = (seq_lens - window).clamp(min=0) // block_size
        num_blocks = int((cdiv_tensor(seq_lens, block_size) - first_block).max())
        columns = first_block[:, None] + torch.arange(num_blocks, device=q.device)
        columns = columns.clamp(max=tables.shape[1] - 1)
        tables = tables.gather(1, columns).reshape(-1)
        batch = len(metadata.decode_req_indices)
        # [B, Hkv, L, D] views of the gathered blocks
        keys = self._gather(kv_cache, 0, tables, q.dtype).view(batch, -1, *key_cache.shape[2:])
        values = self._gather(kv_cache, 1, tables, q.dtype).view(batch, -1, *value_cache.shape[2:])
        positions = first_block[:, None] * block_size + torch.arange(keys.shape[1], device=q.device)
        mask = positions < seq_lens[:, None]
        if window is not None:
            mask &= positions >= (seq_lens - window)[:, None]
        mask = mask[:, None, None, :]
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

    def _prefill(
        self, q, kv_cache, metadata: TorchAttentionMetadata, req_index: int, scale, window
    ):
        block_size = kv_cache[0].shape[1]
        seq_len = metadata.seq_lens[req_index]
        num_queries = q.shape[0]
        context_start = seq_len - num_queries
        # From the block of the first query's first key in its window on (see _decode).
        first_block = 0 if window is None else max(0, context_start - window + 1) // block_size
        first_key = first_block * block_size
        table = metadata.block_tables[req_index, first_block : cdiv(seq_len, block_size)]
        num_keys = seq_len - first_key
        keys = self._gather(kv_cache, 0, table, q.dtype).flatten(0, 1)[:num_keys]
        values = self._gather(kv_cache, 1, table, q.dtype).flatten(0, 1)[:num_keys]
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)
        query = q.transpose(0, 1)  # [H, n, D]
        if context_start == 0 and window is None:
            out = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            key_positions = torch.arange(first_key, seq_len, device=q.device)
            query_positions = torch.arange(context_start, seq_len, device=q.device)
            mask = key_positions[None, :] <= query_positions[:, None]
            if window is not None:
                mask &= key_positions[None, :] > query_positions[:, None] - window
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return out.transpose(0, 1)
