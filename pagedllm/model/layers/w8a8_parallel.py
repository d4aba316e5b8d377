"""A checkpoint's 8-bit layers (int8 W8A8, FP8) over tensor-parallel ranks, as the packed
layers are (`packed_parallel.py`): every rank keeps whole output rows over the whole K, so
each of its output columns is computed from the same activation scales and the same
dequantized weights as on one rank.

* column-parallel layers (q/k/v, gate/up) keep the rows their fp32 layer would load (a
  replicated KV head's rows included), with their per-channel scales; their input is the
  whole hidden state on every rank, so per-token, per-group and per-tensor activation
  scales are one rank's;
* row-parallel layers (o, down) keep a slice of their output rows over the whole K
  (`row_gather.GatheredRowParallel`): a dynamic activation scale is taken over the whole
  gathered input row (a rank's K slice would see only its part of the row's max), and no
  128 x 128 FP8 block is cut along K.

A mixture's experts split as `w8a8_experts.py` says: gate/up keep their rows as a
column-parallel layer does, and down keeps its output rows over the whole intermediate, its
input gathered (`Int8W8A8ExpertDown`, `TiledDequantExpertDown`), its columns joined by the
block's all-reduce.

A rank's rows may start inside an FP8 block of rows (gate/up's intermediate / tp, a rank's
64 rows of k): those rows keep their block's scales one row each (blocks of [1, bk]), which
dequantizes every weight to the same fp32 value. Padding rows (output rows that do not
divide by tp) are zero weights with scale 1.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model.layers.gguf_parallel import RowSlice, output_row_slice, rank_row_slice
from pagedllm.model.layers.parallel_linear import RowParallelLinear
from pagedllm.model.layers.row_gather import GatheredRowParallel, PartialRowParallel
from pagedllm.model.layers.w8a8_linear import (
    Int8W8A8Linear,
    TiledDequantLinear,
    on_int8_gemm,
    w8a8_layer,
)
from pagedllm.model.layers.w8a8_weights import W8A8Weights
from pagedllm.model.quantization.w8a8_scheme import W8A8Scheme
from pagedllm.utils import cdiv


def _padded(tensor: torch.Tensor, padding: int, fill: float) -> torch.Tensor:
    """`tensor` (a copy, never a view of the checkpoint's whole tensor) and `padding` rows
    of `fill` below it."""
    pad = torch.full((padding, tensor.shape[1]), fill, dtype=torch.float32).to(tensor.dtype)
    return torch.cat([tensor, pad]) if padding else tensor.clone()


def _rank_scales(weights: W8A8Weights, rows: RowSlice) -> tuple[torch.Tensor, W8A8Scheme]:
    """The scales of `rows` (then padding rows'), and the scheme they are in."""
    end = rows.start + rows.rows
    scheme = weights.scheme
    if scheme.block is None:
        return _padded(weights.scales[rows.start : end], rows.padding, 1.0), scheme
    block_rows, block_cols = scheme.block
    if rows.start % block_rows == 0:  # whole blocks from the first row: kept as blocks
        first = rows.start // block_rows
        mine = weights.scales[first : first + cdiv(rows.rows, block_rows)]
        extra = cdiv(rows.rows + rows.padding, block_rows) - len(mine)
        return _padded(mine, extra, 1.0), scheme
    per_row = weights.scales[torch.arange(rows.start, end) // block_rows]
    return _padded(per_row, rows.padding, 1.0), replace(scheme, block=(1, block_cols))


def take_w8a8_rows(weights: W8A8Weights, rows: RowSlice) -> W8A8Weights:
    """`rows` of the layer's outputs, with their scales, then the padding rows."""
    values = _padded(weights.values[rows.start : rows.start + rows.rows], rows.padding, 0.0)
    scales, scheme = _rank_scales(weights, rows)
    return W8A8Weights(values, scales.contiguous(), scheme, weights.input_scale)


def rank_w8a8_weights(module: nn.Module, shard_id: str | None, weights: W8A8Weights) -> W8A8Weights:
    """This rank's rows of one layer's (or fused shard's) weights for the 8-bit layer
    replacing `module`; all of them for a layer not split over ranks."""
    rows = rank_row_slice(module, shard_id, weights.out_features)
    if rows == RowSlice(0, weights.out_features):
        return weights
    return take_w8a8_rows(weights, rows)


class _W8A8RowParallel(GatheredRowParallel):
    """This rank's output rows of an 8-bit layer over the whole K, its input gathered first
    (module docstring). The bias is [full_out_features], whole on every rank: added after
    the gather."""

    def __init__(
        self,
        weights: W8A8Weights,
        full_out_features: int,
        tp_group: GroupCoordinator,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__(weights, bias)  # type: ignore[call-arg]  # the kernel layer's
        self.full_out_features = full_out_features
        self.tp_group = tp_group


class Int8W8A8RowParallelLinear(_W8A8RowParallel, Int8W8A8Linear):
    """o / down on int8 weights and int8 activations, row-parallel by output rows."""


class TiledDequantRowParallelLinear(_W8A8RowParallel, TiledDequantLinear):
    """o / down on fp8 (or weight-only int8) weights, row-parallel by output rows."""


def parallel_w8a8_layer(module: nn.Module, weights: W8A8Weights) -> nn.Module:
    """The 8-bit layer for unfused `module` from this rank's rows (`rank_w8a8_weights`):
    the row-parallel one where `module` is split over several ranks."""
    if not (isinstance(module, RowParallelLinear) and module.tp_size > 1):
        return w8a8_layer(weights, module.bias)
    row_parallel = (
        Int8W8A8RowParallelLinear if on_int8_gemm(weights.scheme) else TiledDequantRowParallelLinear
    )
    full = module.weight.shape[0]
    return row_parallel(weights, full, module.tp_group, module.bias)


class Int8W8A8ExpertDown(PartialRowParallel, Int8W8A8RowParallelLinear):
    """An expert's down on int8 weights and activations: this rank's output rows over the
    gathered intermediate, zeros elsewhere (the block's all-reduce joins them)."""


class TiledDequantExpertDown(PartialRowParallel, TiledDequantRowParallelLinear):
    """An expert's down on fp8 (or weight-only int8) weights, as `Int8W8A8ExpertDown`."""


def expert_down_layer(weights: W8A8Weights, tp_group: GroupCoordinator) -> nn.Module:
    """One expert's down [hidden, intermediate] (whole, as the checkpoint holds it) on this
    rank of `tp_group`: all of it on one rank, else its equal share of output rows."""
    if tp_group.world_size == 1:
        return w8a8_layer(weights)
    hidden = weights.out_features
    rows = output_row_slice(hidden, tp_group.rank_in_group, tp_group.world_size)
    down = Int8W8A8ExpertDown if on_int8_gemm(weights.scheme) else TiledDequantExpertDown
    return down(take_w8a8_rows(weights, rows), hidden, tp_group)
