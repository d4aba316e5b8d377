"""A checkpoint's packed integer layers (GPTQ, AWQ, compressed-tensors pack-quantized) over
tensor-parallel ranks, as GGUF blocks are (`gguf_parallel.py`): every rank keeps whole
output rows, each with all its input groups, so its output columns are computed exactly as
one rank computes them.

* column-parallel layers (q/k/v, gate/up) keep the rows their fp32 layer would load, with
  their scales and zero points (a replicated KV head's rows included); the input order of
  an act-order layer is over K, which every rank keeps whole;
* row-parallel layers (o, down) keep a slice of their output rows over the whole K
  (`row_gather.GatheredRowParallel`): no group is cut, whatever the group size and K / tp,
  and an act-order layer's input order applies to the gathered input as on one rank.
  Padding rows (output rows that do not divide by tp) have scale 0: weight 0, and a zero
  point at the midpoint so a symmetric layer stays without a min table.

A mixture's experts split as `GroupedExperts` splits them (`packed_experts.py`): each rank
keeps its rows of every expert's gate and up, and its slice of every expert's down INPUTS
(`take_input_columns`), whole groups only, so the block's one all-reduce sums the ranks'
partial outputs as it does for fp32 experts; a gathered input per expert would cost one
all-gather per routed expert and layer.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model.layers.gguf_linear import DEFAULT_DIGITS
from pagedllm.model.layers.gguf_parallel import RowSlice, rank_row_slice
from pagedllm.model.layers.gptq_linear import GPTQLinear
from pagedllm.model.layers.parallel_linear import RowParallelLinear
from pagedllm.model.layers.row_gather import GatheredRowParallel
from pagedllm.model.quantization.gptq_format import UnpackedGPTQ


def take_output_rows(weights: UnpackedGPTQ, rows: RowSlice) -> UnpackedGPTQ:
    """`rows` of the layer's outputs (its integers, scales and zero points), then the
    padding rows of the module docstring."""
    end = rows.start + rows.rows
    q, scales, zeros = (
        weights.q[rows.start : end],
        weights.scales[rows.start : end],
        weights.zeros[rows.start : end],
    )
    if rows.padding:
        midpoint = 2 ** (weights.bits - 1)
        q = torch.cat([q, q.new_full((rows.padding, q.shape[1]), midpoint)])
        scales = torch.cat([scales, scales.new_zeros(rows.padding, scales.shape[1])])
        zeros = torch.cat([zeros, zeros.new_full((rows.padding, zeros.shape[1]), midpoint)])
    return UnpackedGPTQ(q, scales, zeros, weights.order, weights.group_size, weights.bits)


def take_input_columns(weights: UnpackedGPTQ, start: int, count: int) -> UnpackedGPTQ:
    """Inputs [start, start + count) of the layer with their groups' scales and zero points
    (all of them: the layer itself). Raises ValueError where the slice would cut a group or
    the layer reorders its inputs (act-order mixes every slice's inputs into its groups)."""
    inputs = weights.q.shape[1]
    if count == inputs:
        return weights
    q, group_size = weights.q[:, start : start + count], weights.group_size
    if weights.order is not None:
        raise ValueError("an act-order layer's groups take inputs from every rank's slice")
    if group_size == inputs:  # one group a row: every slice keeps its scale
        return UnpackedGPTQ(q, weights.scales, weights.zeros, None, count, weights.bits)
    if start % group_size or count % group_size:
        raise ValueError(f"a slice of {count} inputs cuts the groups of {group_size}")
    groups = slice(start // group_size, (start + count) // group_size)
    return UnpackedGPTQ(
        q, weights.scales[:, groups], weights.zeros[:, groups], None, group_size, weights.bits
    )


def rank_weights(module: nn.Module, shard_id: str | None, weights: UnpackedGPTQ) -> UnpackedGPTQ:
    """This rank's rows of one layer's (or fused shard's) weights for the packed layer
    replacing `module`; all of them for a layer not split over ranks."""
    rows = rank_row_slice(module, shard_id, weights.q.shape[0])
    if rows == RowSlice(0, weights.q.shape[0]):
        return weights
    return take_output_rows(weights, rows)


class GPTQRowParallelLinear(GatheredRowParallel, GPTQLinear):
    """A row-parallel layer (o, down) on packed integer weights: this rank's output rows over
    the whole K, its input gathered first (module docstring)."""

    def __init__(
        self,
        weights: UnpackedGPTQ,
        full_out_features: int,
        tp_group: GroupCoordinator,
        bias: torch.Tensor | None = None,
        digits: int = DEFAULT_DIGITS,
    ) -> None:
        # The bias is [full_out_features], whole on every rank: added after the gather.
        super().__init__(weights, bias, digits)
        self.full_out_features = full_out_features
        self.tp_group = tp_group


def parallel_packed_layer(module: nn.Module, weights: UnpackedGPTQ) -> GPTQLinear:
    """The packed layer for unfused `module` from this rank's rows (`rank_weights`): the
    row-parallel one where `module` is split over several ranks."""
    if isinstance(module, RowParallelLinear) and module.tp_size > 1:
        full = module.weight.shape[0]
        return GPTQRowParallelLinear(weights, full, module.tp_group, module.bias)
    return GPTQLinear(weights, module.bias)
