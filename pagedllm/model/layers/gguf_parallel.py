"""GGUF blocks over tensor-parallel ranks (`quantization="gguf"`, tensor_parallel_size > 1).

Every rank keeps whole rows of the file's blocks, never part of a row, so a rank's output
columns are computed exactly as one rank computes them (the kernel computes each output
column from its own row and the whole input row; `tests/model/test_gguf_tensor_parallel.py`
checks it bit for bit):

* column-parallel layers (q/k/v, gate/up) keep the rows their fp32 layer would load
  (`shard_sources`: a replicated KV head's rows included);
* the embedding and the head keep their vocabulary shard's rows (`VocabShard`), with zero
  rows for the padding past the vocabulary: zero bytes are d = 0 in every block type, so
  those weights are 0, as the fp32 shard's zeroed padding rows are;
* row-parallel layers (o, down) keep a slice of their OUTPUT rows over the whole K, not the
  fp32 layer's slice of K. Why: a rank's K slice (its heads' head_dim, or intermediate / tp)
  is often no multiple of the block (32 weights; 256 for K-quants), and a block cannot be
  cut (its scale covers all its weights); where it is a multiple, each rank's partial sum
  plus an all-reduce would still add in another order than one rank's kernel does.
  Gathering the input shards instead (the activation, [tokens, K]) lets each rank compute
  its output columns over the whole K inside the kernel, as one rank does, and a second
  all-gather of the outputs ([tokens, hidden / tp] from each) joins them: correct for
  every shape, and one rank's numbers bit for bit (the logits too, wherever the fp32
  layers between give one rank's: the `cpu` attention kernel's change with the number of
  q heads a KV head serves on a rank). Both all-gathers move activations, a few KB a
  token, never weights (they go through torch.distributed: the shared-memory path,
  `shm_allreduce.py`, only all-reduces). Output rows that do not divide by tp are padded
  with zero rows to equal shares (the all-gather needs them) and cut off after it.

Each rank holds about 1/tp of every sharded weight: the file's rows are views of its
mapping until packed, and only this rank's are packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model.layers.gguf_embedding import GGUFEmbedding
from pagedllm.model.layers.gguf_linear import DEFAULT_DIGITS, GGUFLinear
from pagedllm.model.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pagedllm.model.layers.row_gather import GatheredRowParallel
from pagedllm.model.layers.vocab_parallel import (
    ParallelLMHead,
    VocabParallelEmbedding,
    VocabShard,
)
from pagedllm.utils import cdiv


@dataclass(frozen=True)
class RowSlice:
    """This rank's rows of a [rows, row bytes] GGUF tensor: `rows` from `start`, then
    `padding` zero rows."""

    start: int
    rows: int
    padding: int = 0


def output_row_slice(full_rows: int, rank: int, tp: int) -> RowSlice:
    """A row-parallel layer's output rows on `rank`: equal shares of ceil(rows / tp), the
    last ones padded with zero rows (see the module docstring)."""
    share = cdiv(full_rows, tp)
    start = min(full_rows, rank * share)
    rows = min(full_rows, start + share) - start
    return RowSlice(start, rows, share - rows)


def vocab_row_slice(shard: VocabShard, full_rows: int) -> RowSlice:
    """The vocabulary shard's rows; its rows past the real vocabulary are zero rows."""
    _check_rows(full_rows, shard.vocab_size, "vocabulary")
    real = max(0, min(shard.end, shard.vocab_size) - shard.start)
    return RowSlice(min(shard.start, shard.vocab_size), real, shard.rows - real)


def rank_row_slice(module: nn.Module, shard_id: str | None, full_rows: int) -> RowSlice:
    """The rows of a checkpoint tensor of `full_rows` rows (`shard_id`'s, for a fused
    layer) that this rank's GGUF layer keeps in place of `module`; all of them for a layer
    that is not split over ranks."""
    if isinstance(module, MergedColumnParallelLinear):  # q/k/v and gate/up
        start, expected = module.shard_sources[shard_id]
        _check_rows(full_rows, expected, f"shard {shard_id!r}")
        piece = module.shard_slices[shard_id]
        return RowSlice(start, piece.stop - piece.start)
    if isinstance(module, ColumnParallelLinear):
        rows = module.weight.shape[0]
        _check_rows(full_rows, rows * module.tp_size, "column-parallel output")
        return RowSlice(module.tp_rank * rows, rows)
    if isinstance(module, ParallelLMHead | VocabParallelEmbedding):
        return vocab_row_slice(module.shard, full_rows)
    if isinstance(module, RowParallelLinear):
        _check_rows(full_rows, module.weight.shape[0], "row-parallel output")
        return output_row_slice(full_rows, module.tp_rank, module.tp_size)
    return RowSlice(0, full_rows)


def take_rows(raw: np.ndarray, rows: RowSlice) -> list[np.ndarray]:
    """The rows as parts for `pack_gguf`: a view of the file's rows, then the zero rows (a
    part list: `pack_gguf` packs each part into its own tiles, copying the parts together
    only where the file's rows end inside a tile)."""
    parts = [raw[rows.start : rows.start + rows.rows]] if rows.rows else []
    if rows.padding:
        parts.append(np.zeros((rows.padding, raw.shape[1]), dtype=raw.dtype))
    return parts


def rank_rows(module: nn.Module, shard_id: str | None, raw: np.ndarray) -> list[np.ndarray]:
    """This rank's rows of `raw` for the GGUF layer replacing `module` (`rank_row_slice`)."""
    return take_rows(raw, rank_row_slice(module, shard_id, len(raw)))


def _check_rows(full_rows: int, expected: int, what: str) -> None:
    if full_rows != expected:
        raise ValueError(f"the file's {what} tensor has {full_rows} rows, expected {expected}")


class GGUFRowParallelLinear(GatheredRowParallel, GGUFLinear):
    """A row-parallel layer (o, down) on GGUF blocks: this rank's output rows over the whole
    K (`row_gather.GatheredRowParallel`): one rank's sums, in one rank's order."""

    def __init__(
        self,
        raw: list[np.ndarray],
        ggml_type: GGMLQuantizationType,
        full_out_features: int,
        tp_group: GroupCoordinator,
        bias: torch.Tensor | None = None,
        digits: int = DEFAULT_DIGITS,
    ) -> None:
        # The bias is [full_out_features], whole on every rank: added after the gather.
        super().__init__(raw, ggml_type, bias, digits)
        self.full_out_features = full_out_features
        self.tp_group = tp_group


class GGUFParallelLMHead(GGUFLinear):
    """The head's vocabulary shard on GGUF blocks (`ParallelLMHead`): the full logits on the
    group's rank 0, None on the others (a collective)."""

    def __init__(
        self,
        raw: list[np.ndarray],
        ggml_type: GGMLQuantizationType,
        shard: VocabShard,
        digits: int = DEFAULT_DIGITS,
    ) -> None:
        super().__init__(raw, ggml_type, None, digits)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        return self.shard.gather_logits(super().forward(x))


class GGUFVocabParallelEmbedding(GGUFEmbedding):
    """The embedding's vocabulary shard on GGUF blocks (`VocabParallelEmbedding`): ids
    outside the shard give zeros, and the all-reduce adds the one rank's row to zeros
    (exact: every rank ends with one rank's rows)."""

    def __init__(
        self,
        tables: dict[str, torch.Tensor],
        ggml_type: GGMLQuantizationType,
        shard: VocabShard,
        embedding_dim: int,
    ) -> None:
        super().__init__(tables, ggml_type, shard.rows, embedding_dim)
        self.shard = shard

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.shard.start) & (input_ids < self.shard.end)
        out = super().forward(torch.where(mine, input_ids - self.shard.start, 0))
        out.masked_fill_(~mine.unsqueeze(-1), 0)
        return self.shard.tp_group.all_reduce(out)


def parallel_gguf_layer(
    module: nn.Module, raw: list[np.ndarray], ggml_type: GGMLQuantizationType
) -> GGUFLinear:
    """The GGUF layer of one type for unfused `module`, from this rank's rows (`rank_rows`):
    the row-parallel or head layer where `module` is split over several ranks."""
    if isinstance(module, ParallelLMHead) and module.tp_size > 1:
        return GGUFParallelLMHead(raw, ggml_type, module.shard)
    if isinstance(module, RowParallelLinear) and module.tp_size > 1:
        full = module.weight.shape[0]
        return GGUFRowParallelLinear(raw, ggml_type, full, module.tp_group, module.bias)
    return GGUFLinear(raw, ggml_type, module.bias)


def gguf_embedding(
    embedding: nn.Module,
    tables: dict[str, torch.Tensor],
    ggml_type: GGMLQuantizationType,
    source: GGUFLinear,
) -> GGUFEmbedding:
    """The GGUF embedding replacing `embedding`, on `source`'s tables (this rank's rows)."""
    if isinstance(embedding, VocabParallelEmbedding) and embedding.tp_size > 1:
        return GGUFVocabParallelEmbedding(tables, ggml_type, embedding.shard, source.in_features)
    return GGUFEmbedding(tables, ggml_type, source.out_features, source.in_features)
