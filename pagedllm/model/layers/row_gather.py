"""A row-parallel layer (o, down) on quantized weights that keeps OUTPUT rows, not inputs.

A quantized layer's inputs come in groups that share one scale (a GGUF block, a GPTQ /
AWQ group), and act-order reorders them; cutting K per rank, as the fp32 layer does, would
cut groups (a rank's K slice is often no whole number of them) or scatter an act-order
layer's groups over ranks, and even where it fits, each rank's partial sum plus an
all-reduce adds in another order than one rank's kernel. An 8-bit layer (int8 W8A8, FP8)
quantizes its input on every call with a scale per token (or group, or tensor) taken over
the whole row, which a rank's K slice does not hold. Instead each rank keeps a slice of
the output rows over the whole K: the input shards are all-gathered (the ranks' columns in
rank order are the layer's K in order), the rank computes its output columns in one kernel
call as one rank does, and a second all-gather joins the outputs. Both move activations, a
few KB a token, never weights. Output rows that do not divide by tp are padded with zero
rows to equal shares (the all-gather needs them) and cut off after it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.distributed.parallel_state import GroupCoordinator


class GatheredRowParallel:
    """Mixin over a kernel layer with `matmul_into`, `out_features` (this rank's rows,
    padding included) and `bias` (whole on every rank): the forward of the module
    docstring. `full_out_features` and `tp_group` are set by the subclass."""

    full_out_features: int
    tp_group: GroupCoordinator
    out_features: int
    bias: torch.Tensor | None
    matmul_into: Callable[[torch.Tensor, torch.Tensor], None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.joined_output(self.own_rows(self.gathered_input(x)), x.shape[:-1])

    # The forward's three steps apart, so that LoRA adds a rank's delta to its own rows
    # (computed over the gathered input too) before the outputs are joined.
    def gathered_input(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, K]: every rank's input columns, in rank order."""
        return self.tp_group.all_gather(x.reshape(-1, x.shape[-1]), dim=-1)

    def own_rows(self, whole: torch.Tensor) -> torch.Tensor:
        """[tokens, out_features]: this rank's output columns over the whole input."""
        mine = torch.empty((whole.shape[0], self.out_features), dtype=torch.float32)
        self.matmul_into(whole, mine)
        return mine

    def joined_output(self, mine: torch.Tensor, leading: torch.Size) -> torch.Tensor:
        """Every rank's output columns joined (padding cut), the bias added once."""
        out = self.tp_group.all_gather(mine, dim=-1)
        if out.shape[-1] != self.full_out_features:  # padding rows of the last shares
            out = out[:, : self.full_out_features].contiguous()
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*leading, self.full_out_features)

    @property
    def first_output_row(self) -> int:
        """The layer's output row this rank's rows start at (equal shares, the last ones
        padded: `gguf_parallel.output_row_slice`)."""
        return min(self.full_out_features, self.tp_group.rank_in_group * self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, full_out_features={self.full_out_features}"  # type: ignore[misc]


class PartialRowParallel(GatheredRowParallel):
    """`GatheredRowParallel` inside a block whose output the ranks all-reduce anyway (a
    mixture's experts, `FusedMoE`): instead of the second all-gather, this rank's output
    columns are written into zeros of the full width and the block's one all-reduce joins
    the ranks' columns (adding zeros is exact). A bias is added by rank 0 only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mine = self.own_rows(self.gathered_input(x))
        out = mine.new_zeros(mine.shape[0], self.full_out_features)
        first = self.first_output_row
        real = min(self.out_features, self.full_out_features - first)  # padding rows cut
        out[:, first : first + real] = mine[:, :real]
        if self.bias is not None and self.tp_group.rank_in_group == 0:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.full_out_features)
