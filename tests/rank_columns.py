"""What the single-process tensor-parallel layer tests compare: an input with an outlier
channel, and one rank's output columns as a whole layer computes them; and the stand-in
group the ranks' layers are built under, one after another in one process."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model.layers import parallel_linear
from pagedllm.model.layers.gguf_parallel import RowSlice


class StandInGroup(GroupCoordinator):
    """Rank `rank` of a `tp`-rank group in this process (no collective is called here)."""

    def __init__(self, rank: int, tp: int) -> None:
        super().__init__(list(range(tp)), rank, torch.device("cpu"))


def switch_rank(monkeypatch: pytest.MonkeyPatch, rank: int, tp: int) -> None:
    """Parallel layers built next see rank `rank` of a `tp`-rank group."""
    group = StandInGroup(rank, tp)
    monkeypatch.setattr(parallel_linear, "get_tp_group", lambda: group)


def outlier_input(rows: int, cols: int) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    x[:, 7] *= 50  # an outlier channel
    return x


def rank_columns(out: torch.Tensor, rows: RowSlice) -> torch.Tensor:
    """One rank's output columns of `rows` as a whole layer computes them, then zeros."""
    real = out[:, rows.start : rows.start + rows.rows]
    return torch.cat([real, real.new_zeros(real.shape[0], rows.padding)], dim=1)
