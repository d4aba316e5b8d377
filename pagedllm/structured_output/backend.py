"""The structured-output backend interface (the registry that picks one by name is
`registry.py`; applying a filled bitmask to logits is `sample/grammar_bitmask.py`).

A backend compiles a spec into a grammar once (compiled grammars are shared), and makes a
per-request matcher from it: it accepts the tokens the request samples, fills that request's
row of the next-token bitmask (bit i set: token i allowed), rolls back, and says when the
grammar is complete.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
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
