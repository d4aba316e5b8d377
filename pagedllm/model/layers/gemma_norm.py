"""Gemma's RMSNorm: the weight is stored as an offset from one and the whole normalization,
scaling included, runs in float32 before the result is cast back (Transformers'
`Gemma3RMSNorm`; Llama's norm instead casts before scaling, so the two differ in bf16).

Like `RMSNorm` it can take the residual stream and add it first, returning
(norm(x + residual), x + residual), so decoder layers use either norm the same way. In
float32 the two orders are one computation, so an fp32 model runs the fused RMSNorm kernel
(one pass over memory where the torch sequence makes six), which adds the one to each weight
as it reads it (`weight_offset`), in fp32 as `1.0 + w` does. No scale tensor is made: a Gemma
3 270M decode step runs 109 norms, and making 1 + w each time cost ~9 us apiece eagerly (an
add and an allocation), and a kernel and an allocation each inside the compiled graph.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.layers.linear import default_weight_loader, set_weight_loader
from pagedllm.ops import fused
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection


class GemmaRMSNorm(nn.Module):
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
        # Zero offset: the identity scale, as Transformers initializes it.
        self.weight = set_weight_loader(
            nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False),
            default_weight_loader,
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(norm(x), None), or with a residual (norm(x + residual), x + residual)."""
        if x.dtype == torch.float32 and self.kernels.fused_ops:
            return fused.rms_norm(
                x, self.weight, self.eps, residual, self.kernels, weight_offset=1.0
            )
        if residual is not None:
            x = x + residual  # in the model's dtype, as Transformers adds the stream
            residual = x
        return self._normalize(x), residual

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # Transformers' operation order, so fp32 results are the same bits.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)
