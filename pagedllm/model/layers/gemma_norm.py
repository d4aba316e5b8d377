"""Gemma's RMSNorm: the weight is stored as an offset from one and the whole normalization,
scaling included, runs in float32 before the result is cast back (Transformers'
`Gemma3RMSNorm`; Llama's norm instead casts before scaling, so the two differ in bf16).

Like `RMSNorm` it can take the residual stream and add it first, returning
(norm(x + residual), x + residual), so decoder layers use either norm the same way. In
float32 the two orders are one computation, so an fp32 model runs the fused RMSNorm kernel
with the scale 1 + w (one pass over memory where the torch sequence makes six). The scale is
kept between calls: a Gemma 3 270M decode step runs 109 norms, and making it each time cost
~9 us apiece (an add and an allocation), a tenth of the step's time outside its matmuls.
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
        self._scale: torch.Tensor | None = None
        self._scale_source: tuple[int, int, int] | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(norm(x), None), or with a residual (norm(x + residual), x + residual)."""
        if x.dtype == torch.float32 and self.kernels.fused_ops:
            return fused.rms_norm(x, self.scale(), self.eps, residual, self.kernels)
        if residual is not None:
            x = x + residual  # in the model's dtype, as Transformers adds the stream
            residual = x
        return self._normalize(x), residual

    def scale(self) -> torch.Tensor:
        """1 + w, made again only when the weight is another tensor or was written since
        (loading copies into it, bumping its version; moving it to huge pages replaces it)."""
        weight = self.weight
        if torch.compiler.is_compiling() or weight.is_inference():
            return 1.0 + weight  # traced into the graph; an inference tensor has no version
        source = (id(weight), weight.data_ptr(), weight._version)
        if source != self._scale_source:
            self._scale, self._scale_source = 1.0 + weight, source
        return self._scale

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # Transformers' operation order, so fp32 results are the same bits.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)
