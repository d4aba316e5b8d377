"""RMSNorm, computed in float32 whatever the model dtype (as the reference implementation does),
optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.layers.linear import default_weight_loader, set_weight_loader
from pagedllm.ops import fused
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        kernels: KernelSelection = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = set_weight_loader(
            nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False),
            default_weight_loader,
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(norm(x), None), or with a residual (norm(x + residual), x + residual)."""
        return fused.rms_norm(x, self.weight, self.eps, residual, self.kernels)
