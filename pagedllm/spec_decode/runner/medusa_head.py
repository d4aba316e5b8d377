"""`MedusaHeads`: Medusa's parallel prediction heads as a module.

Each head is a stack of residual blocks, x + SiLU(W x + b), then a logits head over the
target's vocabulary: its own, one shared by every head (vLLM's `original_lm_head`), or the
target's when the checkpoint holds none. Every head reads the same input, the target's
normed hidden state of a position p, and head i scores the token at p + i + 2 (the target's
own lm_head scores p + 1). The heads are position-wise: no attention, no KV.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.model.layers.linear import Linear
from pagedllm.ops.kernel_selection import KernelSelection


class ResidualBlocks(nn.Module):
    """One head's blocks: x + SiLU(W x + b), `num_layers` times."""

    def __init__(self, hidden_size, num_layers, bias, dtype, kernels: KernelSelection):
        super().__init__()
        self.layers = nn.ModuleList(
            Linear(hidden_size, hidden_size, bias, dtype, kernels) for _ in range(num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_layers: int,
        hidden_size: int,
        vocab_size: int,
        bias: bool,
        lm_head_of: list[int | None],
        dtype: torch.dtype,
        kernels: KernelSelection,
        logit_scale: float = 1.0,
    ) -> None:
        """`lm_head_of[i]`: which of the checkpoint's lm_heads head i scores with (None:
        the target's, given by `share_target_logits`)."""
        super().__init__()
        self.blocks = nn.ModuleList(
            ResidualBlocks(hidden_size, num_layers, bias, dtype, kernels) for _ in range(num_heads)
        )
        num_own = len({index for index in lm_head_of if index is not None})
        self.lm_heads = nn.ModuleList(
            Linear(hidden_size, vocab_size, False, dtype, kernels) for _ in range(num_own)
        )
        self.lm_head_of = lm_head_of
        self.logit_scale = logit_scale
        # The target's compute_logits, kept outside the module tree (nothing packs it twice).
        self._target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def share_target_logits(self, compute_logits: Callable[[torch.Tensor], torch.Tensor]):
        self._target_logits = compute_logits

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """[rows, vocabulary] float32 logits of each head, in order."""
        return [self._logits(i, block(hidden)) for i, block in enumerate(self.blocks)]

    def _logits(self, head: int, x: torch.Tensor) -> torch.Tensor:
        index = self.lm_head_of[head]
        if index is None:
            assert self._target_logits is not None, "a head without lm_head uses the target's"
            logits = self._target_logits(x).float()
        else:
            logits = self.lm_heads[index](x).float()
        return logits if self.logit_scale == 1.0 else logits * self.logit_scale
