"""`PendingStates`: one request's target hidden states that a head has not read yet, by
position.

The target hands over the states of every position it computes (prefill chunks, verified
drafts, steps that did not speculate); the head reads them when it next proposes, from
where its own KV is valid to the request's last verified position. A step's states past
what was accepted (rejected drafts) are dropped when a later step computes those positions
again or the head reads up to them.
"""

from __future__ import annotations

import torch


class PendingStates:
    def __init__(self) -> None:
        self.start = 0  # the position of the first state held
        self._chunks: list[torch.Tensor] = []
        self._num_held = 0

    @property
    def end(self) -> int:
        """One past the last position held."""
        return self.start + self._num_held

    def receive(self, first_position: int, states: torch.Tensor) -> None:
        """States of positions [first_position, first_position + len(states)). Positions
        computed again replace what was held from there on; after a gap (positions the
        target did not compute: a prefix-cache hit) only the new ones are held."""
        self.truncate(first_position)
        if self._num_held and first_position != self.end:
            self.truncate(0)
        if not self._num_held:
            self.start = first_position
        self._chunks.append(states.clone())  # not a view that keeps the step's tensor alive
        self._num_held += len(states)

    def truncate(self, num_positions: int) -> None:
        """Forget the states of positions >= `num_positions`."""
        if num_positions >= self.end:
            return
        keep = max(0, num_positions - self.start)
        if keep == 0:
            self._chunks, self._num_held = [], 0
            return
        held = torch.cat(self._chunks)[:keep]
        self._chunks, self._num_held = [held], keep

    def take(self, start: int, end: int) -> torch.Tensor:
        """The states of positions [start, end) (all held); nothing is held after (the
        positions from `end` on are the step's rejected drafts, computed again later)."""
        assert self.start <= start <= end <= self.end, "states taken must be held"
        held = torch.cat(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        taken = held[start - self.start : end - self.start]
        self._chunks, self._num_held, self.start = [], 0, end
        return taken
