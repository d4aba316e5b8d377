"""The structured-output backend interface, and the registry that picks a backend by name.

A backend compiles a spec into a grammar once (compiled grammars are shared), and makes a
per-request matcher from it: it accepts the tokens the request samples, fills that request's
row of the next-token bitmask (bit i set: token i allowed), rolls back, and says when the
grammar is complete.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.sampling_params import StructuredOutputsParams


class GrammarMatcher(ABC):
    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 words, 32 tokens each)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abstractmethod
    def is_terminated(self) -> bool: ...


class StructuredOutputBackend(ABC):
    name: str

    @abstractmethod
    def compile(self, spec: StructuredOutputsParams) -> Any:
        """Compile a spec (slow; runs in a worker thread). Raises ValueError if invalid."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher: ...

    @abstractmethod
    def validate(self, spec: StructuredOutputsParams) -> None:
        """Check a spec without a tokenizer (cheap): ValueError saying what is wrong."""


def create_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
    if name == "xgrammar":
        from pagedllm.structured_output.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(tokenizer, vocab_size, eos_token_ids)
    raise ValueError(f"structured output backend {name!r} is unknown; known: xgrammar")


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@functools.cache
def _native_apply() -> Callable[..., None] | None:
    """xgrammar's C++ kernel for the same bitmask layout (30x faster than unpacking the bits
    in torch on the CPU), when xgrammar is installed."""
    try:
        import xgrammar
    except ImportError:
        return None
    return xgrammar.apply_token_bitmask_inplace


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set to -inf the logits of tokens `bitmask` forbids, for logits rows `rows` (in place;
    bitmask row i applies to logits row rows[i])."""
    native = _native_apply()
    if native is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        # The kernel pairs logits row r with bitmask row r: align the rows first.
        aligned = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        aligned[rows] = bitmask
        native(logits, aligned, indices=rows.tolist())
        return
    apply_bitmask_torch(logits, bitmask, rows)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """`apply_bitmask` in plain torch (any device or dtype)."""
    vocab_size = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
    selected = logits[rows]
    selected.masked_fill_(~allowed, float("-inf"))
    logits[rows] = selected
