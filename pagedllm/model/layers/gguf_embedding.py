"""The token embedding kept in GGUF blocks (`quantization="gguf"`): rows dequantized per step.

An 8B model's embedding is 128,256 x 4,096 weights: 2.1 GB in fp32 against ~0.3 GB in its
Q4_K blocks. `GGUFEmbedding` keeps the kernel's packed tables (`gguf_linear.pack_gguf`; a
tied head's own tables, shared) and dequantizes only the rows a step looks up, with the
formula of `gguf.quants.dequantize` for the type, so its values are the fp32 engine's.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.model.layers.gguf_linear import (
    BLOCK,
    KERNEL_TYPES,
    SUPER_BLOCK,
    TILE_COLS,
    distinct_bytes,
)

_T = GGMLQuantizationType
_GROUP_BYTES = 32  # one group: 4 consecutive k for a tile's 8 columns
# What the kernel's unsigned q of a symmetric type is above the file's signed one.
_SYMMETRIC_OFFSETS = {_T.Q4_0: 8.0, _T.Q5_0: 16.0, _T.Q8_0: 128.0}


def _gather_columns(table: torch.Tensor, tile: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """[tiles, n, 8] per-tile values -> [rows, n] of each row's (tile, column)."""
    return table[tile, :, col]


class GGUFEmbedding(nn.Module):
    """input ids -> fp32 rows of a GGUF-quantized [vocab, hidden] weight."""

    def __init__(
        self,
        tables: dict[str, torch.Tensor],
        ggml_type: GGMLQuantizationType,
        num_embeddings: int,
        embedding_dim: int,
    ) -> None:
        super().__init__()
        kind = KERNEL_TYPES[ggml_type]
        self.ggml_type, self.bits, self.kquant = ggml_type, kind.bits, kind.kquant
        self.sub_block = kind.sub_block
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        for name, tensor in tables.items():
            self.register_buffer(name, tensor)

    def _q(self, tile: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """The rows' integers, [rows, hidden] in 0..2^bits - 1."""
        blocks = self.embedding_dim // BLOCK
        planes = self.packed.view(self._tiles(), blocks, -1, _GROUP_BYTES)
        at = (col[:, None] * 4 + torch.arange(4))[:, None, None, :]  # [rows, 1, 1, 4]
        picked = planes[tile]  # [rows, blocks, planes, 32]
        g = picked.gather(3, at.expand(*picked.shape[:3], 4))  # [rows, blocks, planes, 4]
        if self.bits == 8:
            return g.reshape(len(tile), -1)
        nibbles = g[:, :, :4]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)  # [rows, blocks, 8 groups, 4]
        if self.bits == 5:
            shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)
            q = q | (((g[:, :, 4:5] >> shifts) & 1) << 4)
        elif self.bits == 6:
            shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)
            high = (g[:, :, 4:6, None] >> shifts) & 3  # [rows, blocks, plane v, s, 4]
            q = q | (high.reshape(q.shape) << 4)
        return q.reshape(len(tile), -1)

    def _tiles(self) -> int:
        table = self.super_d if self.kquant else self.scales
        return table.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).long()
        # As nn.Embedding: the last tile's padding rows are no tokens. (Ids are checked
        # against the vocabulary at the edge; a compiled graph cannot branch on them.)
        eager = not torch.compiler.is_compiling()
        if eager and len(ids) and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        tile, col = ids // TILE_COLS, ids % TILE_COLS
        q = self._q(tile, col).float()
        rows = len(ids)
        if self.kquant:
            width = self.sub_block
            per_super = SUPER_BLOCK // width
            d = _gather_columns(self.super_d, tile, col).repeat_interleave(per_super, dim=1)
            m = _gather_columns(self.super_m, tile, col).repeat_interleave(per_super, dim=1)
            d = (d * _gather_columns(self.sub_sc, tile, col).float())[..., None]
            q = q.view(rows, -1, width)
            if self.ggml_type == _T.Q6_K:  # gguf's d * (q - 32)
                weights = d * (q - 32.0)
            else:  # gguf's d * q - dmin * m; M is -dmin
                weights = d * q - (-m * _gather_columns(self.sub_mn, tile, col).float())[..., None]
        else:
            d = _gather_columns(self.scales, tile, col).float()[..., None]  # the file's fp16
            q = q.view(rows, -1, BLOCK)
            if self.ggml_type == _T.Q4_1:
                weights = q * d + _gather_columns(self.mins, tile, col)[..., None]
            else:  # gguf's d * signed q: Q8_0 is stored + 128, Q5_0 is q - 16, Q4_0 q - 8
                weights = d * (q - _SYMMETRIC_OFFSETS[self.ggml_type])
        return weights.reshape(*input_ids.shape, self.embedding_dim)

    def weight_bytes(self) -> int:
        return distinct_bytes(self.buffers())

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"type={self.ggml_type.name}"
        )
