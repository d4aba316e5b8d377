"""`EagleDrafts`: an EAGLE-3 or EAGLE head proposes each request's next tokens, chained.

The head is a draft model in all but its inputs, so it keeps `DraftModelDrafts`' paged KV
(a pool of the target's blocks, written into the lookahead slots for the chained steps) and
its bookkeeping of q for the rejection sampler. Its inputs at position p are the token at
p + 1 and a hidden state of p: the target's, handed over after every forward
(`observe_target`, kept in `StepStates` until the step's `propose`), or in the chained steps
the head's own of the position before.

After every forward the head catches up on every request the step computed, in one forward:
from where its KV is valid to the last position the step computed whose next token is known
(a prompt chunk's last position reads the prompt's next token; a request that sampled stops
at N - 2 for N tokens, since the state of N - 1 is computed only when the sampled token is
verified). So the head reads a prompt's states chunk by chunk as the target's chunked
prefill runs, and holds no target state past the step: one step's tokens at most, whatever
the prompts' lengths and the number of requests, and nothing for a request between steps
(finished, aborted or preempted). For a request that sampled, the catch-up's logits at N - 2
propose token N, and `num_speculative_tokens - 1` single-token steps propose the rest.
A step the scheduler counts too large to speculate (`disable_by_batch_size` against its
running requests, `SchedulerOutput.speculating`) runs no head at all, and the requests it
computed stop drafting for good: their head KV would have a gap whose states are gone, and
a large batch is where the head's forwards cost more than its drafts save (a preempted
request starts over from the states computed anew; where a prefix-cache hit or a KV tier
gives it blocks back, their head KV is what the cache holds, as below). So speculation is
decided per request by the load it meets, as vLLM's switch decides for requests arriving
under load.
Positions the target did not compute for this request (a prefix-cache hit) have no states:
the head keeps the KV the cache holds there (written by the request that filled those
blocks) and starts after them; exactness never depends on it, only acceptance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.runner.draft_model import DraftModelDrafts
from pagedllm.spec_decode.runner.proposer import TargetStates
from pagedllm.spec_decode.runner.step_states import StepRows, StepStates

if TYPE_CHECKING:
    from pagedllm.runner.input_batch import InputBatch


class CatchUp(NamedTuple):
    """The head's catch-up of one step: positions [start, end) of each request, with the
    target's states of those positions."""

    request_ids: list[str]
    rows: np.ndarray  # each request's row in the batch
    starts: np.ndarray
    ends: np.ndarray
    states: torch.Tensor


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
        self.step_states = StepStates()
        # Requests a step too large to speculate computed: the head no longer drafts for them.
        self._behind: set[str] = set()
        self._speculating = True  # the step's, from the scheduler

    def begin_step(self, speculating: bool) -> None:
        self._speculating = speculating

    def observe_target(self, request_ids, first_positions, num_tokens, states) -> None:
        self.step_states.observe(request_ids, first_positions, num_tokens, states)

    def propose(self, request_ids: list[str], batch: InputBatch) -> dict[str, list[int]]:
        """Drafts for the requests that sampled (`request_ids`), after the catch-up of
        every request the step computed."""
        self._forget_probs(request_ids)
        if not self._speculating:
            self._fall_behind()
            return {}
        catch_up = self._catch_up(batch)
        if catch_up is None:
            return {}
        for_logits, chain = self._forward_head(
            batch, catch_up.rows, catch_up.starts, catch_up.ends, catch_up.states
        )
        for request_id, end in zip(catch_up.request_ids, catch_up.ends.tolist(), strict=True):
            self._num_computed[request_id] = end
        if not request_ids or not self.config.speculates(len(request_ids)):
            return {}
        drafting = self._drafting(catch_up, set(request_ids), batch)
        if not len(drafting):
            return {}
        index = self._tensor(drafting)
        return self._chain(
            [catch_up.request_ids[i] for i in drafting.tolist()],
            batch,
            catch_up.rows[drafting],
            catch_up.ends[drafting],
            for_logits[index],
            chain[index],
        )

    def _fall_behind(self) -> None:
        """Drop the step's states unread; the requests they belong to leave the head."""
        _, step_rows = self.step_states.take()
        self._behind.update(step_rows)

    def remove_request(self, request_id: str) -> None:
        super().remove_request(request_id)
        self._behind.discard(request_id)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        super().truncate(request_id, num_tokens)
        if num_tokens == 0:  # preempted: every state is computed again
            self._behind.discard(request_id)

    @staticmethod
    def _drafting(catch_up: CatchUp, sampled: set[str], batch: InputBatch) -> np.ndarray:
        """Indices into `catch_up` of the requests that sampled and were caught up to
        their last verified position (all of them: it was computed this step)."""
        last_verified = batch.num_tokens[catch_up.rows] - 1
        return np.array(
            [
                i
                for i, request_id in enumerate(catch_up.request_ids)
                if request_id in sampled and catch_up.ends[i] == last_verified[i]
            ],
            dtype=np.int64,
        )

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

    def _catch_up(self, batch: InputBatch) -> CatchUp | None:
        """What the head reads of the step's states (None: nothing); they are not held
        after, read or not."""
        states, step_rows = self.step_states.take()
        if states is None:
            return None
        kept, rows, starts, ends, state_rows = [], [], [], [], []
        for request_id, where in step_rows.items():
            span = self._span(request_id, where, batch)
            if span is None:
                continue
            start, end = span
            kept.append(request_id)
            rows.append(batch.row(request_id))
            starts.append(start)
            ends.append(end)
            state_rows.append(np.arange(where.row_of(start), where.row_of(end - 1) + 1))
        if not kept:
            return None
        taken = states[self._tensor(np.concatenate(state_rows))]
        return CatchUp(kept, _int64(rows), _int64(starts), _int64(ends), taken)

    def _span(self, request_id: str, where: StepRows, batch: InputBatch) -> tuple[int, int] | None:
        """Positions [start, end) of the request the head reads this step: from where its
        KV is valid (or the first the step computed, after a prefix-cache hit) to the last
        the step computed whose next token the batch holds (a prompt's, or the one just
        sampled: the drafts after it are not verified)."""
        if request_id not in self._num_computed or request_id in self._behind:
            return None  # never added, or left behind by a step too large: nothing to read
        num_tokens = int(batch.num_tokens[batch.row(request_id)])
        end = min(where.end, num_tokens - 1)
        start = max(self._num_computed[request_id], where.first_position)
        return (start, end) if start < end else None

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


def _int64(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)
