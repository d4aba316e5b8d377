"""The grammar bitmask's layout (32 tokens per int32 word, bit set: allowed) and applying it
to logits: sampling's side of structured output, which the structured-output manager fills.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from pagedllm.utils import cdiv


def bitmask_words(vocab_size: int) -> int:
    return cdiv(vocab_size, 32)


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
