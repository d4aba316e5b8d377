"""Linear layers whose parameters own their weight loaders (plain and fused q/k/v, gate/up)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedllm.ops import fused
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"weight shape {tuple(loaded_weight.shape)} != expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def set_weight_loader(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class Linear(nn.Module):
    """y = x W^T (+ b); weight shaped [output_size, input_size] as in Hugging Face checkpoints."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        kernels: KernelSelection = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.weight = set_weight_loader(
            nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False),
            self.weight_loader,
        )
        self.bias = None
        if bias:
            self.bias = set_weight_loader(
                nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False),
                self.weight_loader,
            )
        self.kernels = kernels
        # Set by model/layers/onednn.py: the weight packed for oneDNN, a bf16 weight's fp32
        # copy where the CPU multiplies large bf16 batches faster in fp32, and a bf16 weight
        # in AMX tiles for the few rows of decode steps (model/layers/amx_tiles.py).
        self.packed_weight: torch.Tensor | None = None
        self.packed_fp32_weight: torch.Tensor | None = None
        self.packed_amx_weight: torch.Tensor | None = None

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) on the best of the layer's weight copies for x's rows."""
        return fused.linear(
            x,
            self.weight,
            bias,
            self.kernels,
            self.packed_weight,
            self.packed_fp32_weight,
            self.packed_amx_weight,
        )


class MatmulIntoLinear(nn.Module):
    """A linear layer whose kernel writes x W^T into a float32 buffer it is given
    (`matmul_into`: row-parallel and concatenated layers hand it their own, strided,
    buffers); `forward` is that plus the bias, on any leading shape."""

    in_features: int
    out_features: int

    def matmul_into(self, x2: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decoder's input is already what the kernel takes (2-D, fp32, contiguous): the
        # reshapes and the cast below are then no-ops that still cost ~9 us a call.
        flat = x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
        x2 = x if flat else x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        out = torch.empty((x2.shape[0], self.out_features), dtype=torch.float32)
        self.matmul_into(x2, out)
        if self.bias is not None:
            out.add_(self.bias)
        return out if flat else out.reshape(*x.shape[:-1], self.out_features)


class SplitOutputs:
    """For fused projections (fp32 or quantized): `output_sizes` and the split back into them."""

    output_sizes: list[int]

    def split(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return fused.split(self.output_sizes, dim=-1)


class MergedLinear(SplitOutputs, Linear):
    """Several projections of the same input fused into one matmul (q/k/v, gate/up).

    Checkpoints store them apart; each shard's loader copies into its rows of the fused
    weight, so one pass over the checkpoint fills it.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        shard_ids: Sequence[str],
        bias: bool,
        dtype: torch.dtype,
        kernels: KernelSelection = TORCH_KERNELS,
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias, dtype, kernels)
        self.output_sizes = list(output_sizes)
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.shard_slices = {
            shard: slice(offset, offset + size)
            for shard, offset, size in zip(shard_ids, offsets, output_sizes, strict=True)
        }

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None
    ) -> None:
        if shard_id not in self.shard_slices:
            raise ValueError(
                f"unknown shard {shard_id!r}; expected one of {list(self.shard_slices)}"
            )
        default_weight_loader(param.data[self.shard_slices[shard_id]], loaded_weight)
