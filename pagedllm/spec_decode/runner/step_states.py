"""`StepStates`: the target's hidden states of the last forward, by request and position,
from the hand-over after the forward (`observe`) until the proposer reads them after
sampling (`take`).

A head reads every request's states in the step that computed them (a prompt's chunks as
the target's chunked prefill runs them, verified drafts, steps that do not speculate), so
nothing is held past a step: what a proposer holds is one step's tokens at most, a view of
the forward's own output (no copy), and a request that finishes, is aborted or preempted
holds nothing between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StepRows:
    """Where one request's rows sit in the step's states."""

    offset: int  # its first row
    first_position: int
    num_rows: int

    @property
    def end(self) -> int:
        """One past the last position the step computed (rejected drafts included)."""
        return self.first_position + self.num_rows

    def row_of(self, position: int) -> int | None:
        index = position - self.first_position
        return self.offset + index if 0 <= index < self.num_rows else None


class StepStates:
    def __init__(self) -> None:
        self._states: torch.Tensor | None = None
        self._rows: dict[str, StepRows] = {}

    @property
    def num_held(self) -> int:
        """Rows held now (0 between steps)."""
        return 0 if self._states is None else len(self._states)

    def observe(
        self,
        request_ids: list[str],
        first_positions: np.ndarray,
        num_tokens: np.ndarray,
        states: torch.Tensor,
    ) -> None:
        """The step's states [tokens, width]: request i's `num_tokens[i]` rows from
        `first_positions[i]` on (what an earlier step left unread is dropped)."""
        offsets = np.concatenate(([0], np.cumsum(num_tokens)))
        self._states = states
        self._rows = {
            request_id: StepRows(int(offsets[i]), int(first_positions[i]), int(num_tokens[i]))
            for i, request_id in enumerate(request_ids)
        }

    def take(self) -> tuple[torch.Tensor | None, dict[str, StepRows]]:
        """The step's states and each request's rows there; none are held after."""
        states, rows = self._states, self._rows
        self._states, self._rows = None, {}
        return states, rows
