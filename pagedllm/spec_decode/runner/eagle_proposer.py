"""`EagleDrafts`: an EAGLE-3 or EAGLE head proposes each request's next tokens, chained.

The head is a draft model in all but its inputs, so it keeps `DraftModelDrafts`' paged KV
(a pool of the target's blocks, written into the lookahead slots for the chained steps) and
its bookkeeping of q for the rejection sampler. Its inputs at position p are the token at
p + 1 and a hidden state of p: the target's, handed over after every forward
(`observe_target`, held per request in `PendingStates` until the head reads them), or in
the chained steps the head's own of the position before.

When a request samples, the head catches up from where its KV is valid to the request's
last verified position (N - 2 for N tokens: the state of N - 1 is computed only when the
sampled token is verified), in one forward with every other request's catch-up; its logits
at N - 2 propose token N. `num_speculative_tokens - 1` single-token steps propose the rest.
A step that does not speculate still catches the head up: states are not held past it.
Positions the target did not compute for this request (a prefix-cache hit) have no states:
the head keeps the KV the cache holds there (written by the request that filled those
blocks) and starts after them; exactness never depends on it, only acceptance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.runner.draft_model import DraftModelDrafts
from pagedllm.spec_decode.runner.proposer import TargetStates
from pagedllm.spec_decode.runner.target_state_buffer import PendingStates

if TYPE_CHECKING:
    from pagedllm.runner.input_batch import InputBatch


class EagleDrafts(DraftModelDrafts):
    def __init__(
        self,
        config: SpeculativeConfig,
        head: torch.nn.Module,
        target_states: TargetStates,
        attention_backend,
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        super().__init__(config, head, attention_backend, block_size, max_model_len, device)
        self.target_states = target_states
        self._pending: dict[str, PendingStates] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        super().add_request(request_id, prompt_token_ids)
        self._pending[request_id] = PendingStates()

    def remove_request(self, request_id: str) -> None:
        super().remove_request(request_id)
        self._pending.pop(request_id, None)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        super().truncate(request_id, num_tokens)
        if request_id in self._pending:
            self._pending[request_id].truncate(num_tokens)

    def observe_target(self, request_ids, first_positions, num_tokens, states) -> None:
        offsets = np.concatenate(([0], np.cumsum(num_tokens)))
        for index, request_id in enumerate(request_ids):
            pending = self._pending.get(request_id)
            if pending is not None:
                rows = states[offsets[index] : offsets[index + 1]]
                pending.receive(int(first_positions[index]), rows)

    def propose(self, request_ids: list[str], batch: InputBatch) -> dict[str, list[int]]:
        """Drafts for the requests that sampled; in a step too large to speculate
        (`disable_by_batch_size`) the head still catches up, so that the target's states
        are not held past the step (unlike a draft model's tokens, they cannot be had
        again)."""
        self._probs.clear()
        speculates = self.config.speculates(len(request_ids))
        request_ids, spans = self._catch_up_spans(request_ids, batch)
        if not request_ids:
            return {}
        rows, starts, ends, states = spans
        for_logits, chain = self._forward_head(batch, rows, starts, ends, states)
        for request_id, end in zip(request_ids, ends.tolist(), strict=True):
            self._num_computed[request_id] = end
        if not speculates:
            return {}
        return self._chain(request_ids, batch, rows, ends, for_logits, chain)

    def _chain(self, request_ids, batch, rows, ends, for_logits, chain) -> dict[str, list[int]]:
        """d1 from the catch-up's logits, then `num_speculative_tokens - 1` chained steps,
        each reading the head's own state of the position before (`chain`)."""
        chained = [chain]

        def next_logits(positions: np.ndarray, token_ids: np.ndarray) -> torch.Tensor:
            for_logits, chained[0] = self._forward_head(
                batch, rows, positions, positions + 1, chained[0], token_ids
            )
            return self.model.compute_logits(for_logits)

        logits = self.model.compute_logits(for_logits)
        return self._chain_drafts(request_ids, batch, rows, ends, logits, next_logits)

    def _catch_up_spans(self, request_ids: list[str], batch: InputBatch):
        """The requests the head can propose for, and (rows, starts, ends, the target's
        states of those positions); a request whose states are not all held yet (none
        should be: its last verified position was computed this step) proposes nothing."""
        kept, rows, starts, ends, states = [], [], [], [], []
        for request_id in request_ids:
            row = batch.row(request_id)
            end = int(batch.num_tokens[row]) - 1  # the sampled token's position: no state yet
            pending = self._pending[request_id]
            pending.truncate(end)
            start = max(self._num_computed[request_id], pending.start)
            if start >= end or pending.end < end:
                continue
            kept.append(request_id)
            rows.append(row)
            starts.append(start)
            ends.append(end)
            states.append(pending.take(start, end))
        spans = (
            np.array(rows, dtype=np.int64),
            np.array(starts, dtype=np.int64),
            np.array(ends, dtype=np.int64),
            torch.cat(states) if states else None,
        )
        return kept, spans

    def _forward_head(self, batch, rows, starts, ends, hidden, token_ids=None):
        """The head over positions [start, end) of each row, reading the token after each
        position (`token_ids`: one per row instead, a draft) and `hidden` (the target's
        states on catching up, the head's own when chaining): (for_logits, chain) at each
        row's last position."""
        spans = self._spans(batch, rows, starts, ends)
        if token_ids is None:
            token_ids = batch.token_ids[rows[spans.token_row], spans.positions + 1]
            hidden = self.model.project(hidden)
        input_ids = self._tensor(token_ids)
        positions = self._tensor(spans.positions)
        for_logits, chain = self.model(input_ids, positions, hidden, spans.metadata)
        last = self._tensor(spans.last_rows)
        return for_logits[last], chain[last]
