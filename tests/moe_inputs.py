"""Inputs the tests of a mixture's expert blocks feed them (tests/model/test_packed_moe.py,
tests/model/test_gguf_experts.py): seeded hidden states with an outlier channel, and a
top-2 routing that can leave experts without a token."""

from __future__ import annotations

import torch

TOP_K = 2


def routing(num_tokens: int, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-2 among `experts` (the others get no token), and its weights."""
    generator = torch.Generator().manual_seed(4)
    allowed = torch.tensor(experts)
    picks = torch.stack([torch.randperm(len(experts), generator=generator)[:TOP_K]
                         for _ in range(num_tokens)])  # fmt: skip
    weights = torch.softmax(torch.randn(num_tokens, TOP_K, generator=generator), dim=-1)
    return allowed[picks], weights


def hidden_states(num_tokens: int, width: int) -> torch.Tensor:
    x = torch.randn(num_tokens, width, generator=torch.Generator().manual_seed(5))
    x[:, 7] *= 20  # an outlier channel, as in real hidden states
    return x
