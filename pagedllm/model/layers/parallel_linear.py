"""Tensor-parallel linear layers: each rank holds one shard of the weight, cut at load time.

Megatron's split, as vLLM's: a column-parallel layer (q/k/v, gate/up) holds a slice of the
output features and needs no communication; the row-parallel layer after it (o, down) holds
the matching slice of the input features, so its partial products are summed by one
all-reduce, after which the bias is added once. KV heads are split like the q heads when
`num_kv_heads` divides by the group size, else replicated: rank r holds KV head
`r * num_kv_heads // tp`, the one its q heads read (the group size is then a multiple of
`num_kv_heads`, `verify_parallel_layout`).

Weight loaders take the full checkpoint tensor, or a lazy slice of it (anything with
`shape` and `narrow(dim, start, length) -> Tensor`, `model/loader.py`'s `CheckpointSlice`),
check its full shape and copy only this rank's rows or columns, so no rank materializes
another rank's shard. Parameters marked `narrows` take lazy slices; the model materializes
them for every other loader.

The classes subclass `Linear` / `MergedLinear`, so oneDNN packing, int8 and gguf see them as
before; with one rank they are exactly those layers (same shapes, same forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.model.layers.linear import Linear, MergedLinear
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) does not divide by tensor_parallel_size {parts}")
    return total // parts


def mark_narrowing(*params: nn.Parameter | None) -> None:
    """This parameter's loader takes lazy checkpoint slices (it reads only its shard)."""
    for param in params:
        if param is not None:
            param.narrows = True  # type: ignore[attr-defined]


def load_shard(
    dest: torch.Tensor, loaded: Any, dim: int, start: int, full_shape: Sequence[int]
) -> None:
    """Copy `loaded[start : start + dest.shape[dim]]` along `dim` into `dest`, after checking
    that `loaded` (a tensor or a lazy slice) has the full, unsharded shape."""
    if tuple(loaded.shape) != tuple(full_shape):
        raise ValueError(
            f"weight shape {tuple(loaded.shape)} != expected {tuple(full_shape)} "
            f"(this rank holds {tuple(dest.shape)} of it)"
        )
    dest.copy_(loaded.narrow(dim, start, dest.shape[dim]))


def _full_shape(shard: torch.Tensor, dim: int, full_size: int) -> list[int]:
    shape = list(shard.shape)
    shape[dim] = full_size
    return shape


class ColumnParallelLinear(Linear):
    """y_r = x W_r^T (+ b_r): this rank's `output_size / tp` output features."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        kernels: KernelSelection = TORCH_KERNELS,
    ) -> None:
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank_in_group, group.world_size
        super().__init__(
            input_size, divide(output_size, self.tp_size, "output size"), bias, dtype, kernels
        )
        mark_narrowing(self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id=None) -> None:
        size = param.shape[0]
        full = _full_shape(param, 0, size * self.tp_size)
        load_shard(param.data, loaded_weight, 0, self.tp_rank * size, full)


class MergedColumnParallelLinear(MergedLinear):
    """Fused projections of one input (gate/up), each split over the ranks: this rank holds
    its slice of every one, side by side."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        shard_ids: Sequence[str],
        bias: bool,
        dtype: torch.dtype,
        kernels: KernelSelection = TORCH_KERNELS,
    ) -> None:
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank_in_group, group.world_size
        sizes = [
            divide(size, self.tp_size, f"{shard} size")
            for size, shard in zip(output_sizes, shard_ids, strict=True)
        ]
        super().__init__(input_size, sizes, shard_ids, bias, dtype, kernels)
        # Per shard: (first row of this rank's slice in the checkpoint tensor, its full rows).
        self.shard_sources = {
            shard: (self.tp_rank * size, size * self.tp_size)
            for shard, size in zip(shard_ids, sizes, strict=True)
        }
        mark_narrowing(self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id=None) -> None:
        if shard_id not in self.shard_slices:
            raise ValueError(
                f"unknown shard {shard_id!r}; expected one of {list(self.shard_slices)}"
            )
        dest = param.data[self.shard_slices[shard_id]]
        start, full_rows = self.shard_sources[shard_id]
        load_shard(dest, loaded_weight, 0, start, _full_shape(dest, 0, full_rows))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v of `num_heads` / `num_kv_heads` heads: this rank's `num_heads / tp` q heads
    and `max(1, num_kv_heads / tp)` KV heads (`num_heads` and `num_kv_heads` attributes are
    this rank's)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
        kernels: KernelSelection = TORCH_KERNELS,
    ) -> None:
        group = get_tp_group()
        tp, rank = group.world_size, group.rank_in_group
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp, "attention heads")
        if total_num_kv_heads % tp == 0:
            self.num_kv_heads = total_num_kv_heads // tp
            first_kv_head = rank * self.num_kv_heads
        elif tp % total_num_kv_heads == 0:
            self.num_kv_heads = 1
            first_kv_head = rank * total_num_kv_heads // tp
        else:
            raise ValueError(
                f"tensor_parallel_size {tp} neither divides nor is a multiple of the "
                f"{total_num_kv_heads} KV heads"
            )
        kv_shard = self.num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            [total_num_heads * head_dim, kv_shard * tp, kv_shard * tp],
            ["q", "k", "v"],
            bias,
            dtype,
            kernels,
        )
        # A replicated KV head is not the tp-th slice of the checkpoint's rows.
        kv_source = (first_kv_head * head_dim, total_num_kv_heads * head_dim)
        self.shard_sources["k"] = self.shard_sources["v"] = kv_source


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T, then + b: this rank holds `input_size / tp` input
    features (the column-parallel layer before it produced exactly those); one all-reduce
    sums the partial products, and the bias (whole on every rank) is added after it."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        kernels: KernelSelection = TORCH_KERNELS,
    ) -> None:
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.world_size
        super().__init__(
            divide(input_size, self.tp_size, "input size"), output_size, bias, dtype, kernels
        )
        mark_narrowing(self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id=None) -> None:
        if param.dim() == 1:  # the bias: whole on every rank
            load_shard(param.data, loaded_weight, 0, 0, param.shape)
            return
        size = param.shape[1]
        full = _full_shape(param, 1, size * self.tp_size)
        load_shard(param.data, loaded_weight, 1, self.tp_rank * size, full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        return self.reduce_partial(self.partial_forward(x))

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product x_r W_r^T, before the all-reduce and the bias (a LoRA
        layer adds its own rank's delta to it first)."""
        return self.product(x, None)

    def reduce_partial(self, out: torch.Tensor) -> torch.Tensor:
        """The ranks' partial products summed, then the bias added once."""
        out = self.tp_group.all_reduce(out)
        return out if self.bias is None else out.add_(self.bias)
