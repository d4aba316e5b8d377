"""RMSNorm, computed in float32 whatever the model dtype (as the reference implementation does)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.layers.linear import default_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = set_weight_loader(
            nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False),
            default_weight_loader,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)
