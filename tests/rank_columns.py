"""What the single-process tensor-parallel layer tests compare: an input with an outlier
channel, and one rank's output columns as a whole layer computes them."""

from __future__ import annotations

import torch

from pagedllm.model.layers.gguf_parallel import RowSlice


def outlier_input(rows: int, cols: int) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    x[:, 7] *= 50  # an outlier channel
    return x


def rank_columns(out: torch.Tensor, rows: RowSlice) -> torch.Tensor:
    """One rank's output columns of `rows` as a whole layer computes them, then zeros."""
    real = out[:, rows.start : rows.start + rows.rows]
    return torch.cat([real, real.new_zeros(real.shape[0], rows.padding)], dim=1)
