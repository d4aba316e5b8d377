"""Vocabulary-parallel embedding and LM head: each tensor-parallel rank holds a slice of rows.

The vocabulary is padded (`padded_vocab_size`: a multiple of 64 x tp) so every rank holds
the same number of rows; padding rows are zero and never looked up. The embedding looks up
the ids inside its slice, zeroes the others and all-reduces, so every rank ends with the full
embedding. The head computes its slice of the logits; the slices are gathered to the
group's rank 0, concatenated and cut back to `vocab_size` (the other ranks get None: only
rank 0 of the last stage samples). A tied head shares the embedding's shard.

With one rank both are the unsharded layers: same shapes (no padding), same forward, and
`lm_head` builds the plain `Linear` head of a single-process model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.model.layers.linear import Linear, set_weight_loader
from pagedllm.model.layers.parallel_linear import mark_narrowing
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection
from pagedllm.parallel_config import padded_vocab_size


class VocabShard:
    """This rank's rows [start, end) of the padded vocabulary."""

    def __init__(self, vocab_size: int) -> None:
        self.tp_group = get_tp_group()
        tp, rank = self.tp_group.world_size, self.tp_group.rank_in_group
        self.vocab_size = vocab_size
        self.padded_vocab_size = vocab_size if tp == 1 else padded_vocab_size(vocab_size, tp)
        self.rows = self.padded_vocab_size // tp
        self.start = rank * self.rows
        self.end = self.start + self.rows

    def load(self, param: nn.Parameter, loaded_weight: Any) -> None:
        """Copy the checkpoint's rows of this shard; padding rows become zeros."""
        expected = (self.vocab_size, param.shape[1])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"weight shape {tuple(loaded_weight.shape)} != expected {expected}")
        real = max(0, min(self.end, self.vocab_size) - self.start)
        if real:
            param.data[:real].copy_(loaded_weight.narrow(0, self.start, real))
        param.data[real:].zero_()

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Every rank's logits of its rows, joined on the group's rank 0 and cut to the real
        vocabulary (None on the other ranks; a collective)."""
        full = self.tp_group.gather(logits, dst=0, dim=-1)
        if full is None:
            return None
        return full[..., : self.vocab_size].contiguous()


class VocabParallelEmbedding(nn.Module):
    """Token embedding with this rank's rows of the (padded) vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.shard = VocabShard(vocab_size)
        self.tp_size = self.shard.tp_group.world_size
        # The rows' dtype out of the lookup: a weight kept in a checkpoint's 16-bit dtype
        # under fp32 compute (stored_vocab.py) has its gathered rows converted.
        self.compute_dtype = dtype
        self.weight = set_weight_loader(
            nn.Parameter(
                torch.empty(self.shard.rows, hidden_size, dtype=dtype), requires_grad=False
            ),
            self.weight_loader,
        )
        mark_narrowing(self.weight)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id=None) -> None:
        self.shard.load(param, loaded_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight).to(self.compute_dtype)
        mine = (input_ids >= self.shard.start) & (input_ids < self.shard.end)
        local_ids = torch.where(mine, input_ids - self.shard.start, 0)
        out = F.embedding(local_ids, self.weight).to(self.compute_dtype)
        out.masked_fill_(~mine.unsqueeze(-1), 0)
        return self.shard.tp_group.all_reduce(out)


class ParallelLMHead(Linear):
    """Logits for this rank's vocabulary rows; `forward` returns the full logits
    ([tokens, vocab_size]) on the group's rank 0 and None on the others (a collective: every
    rank of the group must call it with the same number of rows)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        kernels: KernelSelection = TORCH_KERNELS,
    ) -> None:
        shard = VocabShard(vocab_size)
        super().__init__(hidden_size, shard.rows, False, dtype, kernels)
        self.shard = shard
        self.tp_size = shard.tp_group.world_size
        mark_narrowing(self.weight)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id=None) -> None:
        self.shard.load(param, loaded_weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        logits = super().forward(hidden_states)
        if self.tp_size == 1:
            return logits
        return self.shard.gather_logits(logits)


def lm_head(
    vocab_size: int,
    hidden_size: int,
    dtype: torch.dtype,
    kernels: KernelSelection = TORCH_KERNELS,
) -> Linear:
    """The model's head: a `ParallelLMHead` in a tensor-parallel group, else the plain
    `Linear` a single process has always had."""
    if get_tp_group().world_size == 1:
        return Linear(hidden_size, vocab_size, False, dtype, kernels)
    return ParallelLMHead(vocab_size, hidden_size, dtype, kernels)
