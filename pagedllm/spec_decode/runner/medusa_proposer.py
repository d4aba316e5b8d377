"""`MedusaDrafts`: Medusa heads propose each request's next tokens from one hidden state.

After a step, a request that sampled holds N tokens; the target's normed hidden state of
position N - 2 scored the token just sampled (N - 1), and head i reads that same state to
propose token N + i. Those states come from the step's own forward (`observe_target`),
so nothing is held past the step and nothing runs again: the heads have no KV.

Each head's draft is drawn as a draft model's is (`draft_sample`): its argmax for a greedy
request, a draw from softmax(logits / temperature) for one that samples, whose q the
rejection sampler reads (a seeded request draws from its own generator, one uniform per
head). The drafts form a chain of `num_speculative_tokens` tokens that the target verifies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.runner.medusa_head import MedusaHeads
from pagedllm.spec_decode.runner.proposer import TargetStates
from pagedllm.spec_decode.runner.rejection_sampler import draft_sample
from pagedllm.spec_decode.runner.sampled_drafts import SampledDrafts
from pagedllm.spec_decode.runner.step_states import StepStates

if TYPE_CHECKING:
    from pagedllm.runner.input_batch import InputBatch


class MedusaDrafts(SampledDrafts):
    target_states = TargetStates()  # the target's normed output

    def __init__(self, config: SpeculativeConfig, heads: MedusaHeads, device: torch.device):
        super().__init__(config, device)
        assert heads.num_heads == config.num_speculative_tokens
        self.heads = heads
        # The last forward's states and each request's rows there (until it proposes).
        self.step_states = StepStates()

    def observe_target(self, request_ids, first_positions, num_tokens, states) -> None:
        self.step_states.observe(request_ids, first_positions, num_tokens, states)

    def propose(self, request_ids: list[str], batch: InputBatch) -> dict[str, list[int]]:
        self._forget_probs(request_ids)
        states, rows = self.step_states.take()
        if states is None or not request_ids or not self.config.speculates(len(request_ids)):
            return {}
        kept, batch_rows, state_rows = [], [], []
        for request_id in request_ids:
            row = batch.row(request_id)
            # The state that scored the token just sampled: always computed in this step.
            step_rows = rows.get(request_id)
            index = None
            if step_rows is not None:
                index = step_rows.row_of(int(batch.num_tokens[row]) - 2)
            if index is None:
                continue
            kept.append(request_id)
            batch_rows.append(row)
            state_rows.append(index)
        if not kept:
            return {}
        hidden = states[self._tensor(np.array(state_rows, dtype=np.int64))]
        return self._draft(kept, batch, np.array(batch_rows, dtype=np.int64), hidden)

    def _draft(self, request_ids, batch: InputBatch, rows, hidden) -> dict[str, list[int]]:
        temperature, generators = self._sampling(batch, rows)
        drafts, probs = [], []
        for logits in self.heads(hidden):  # head by head: a seeded row's draws in order
            token_ids, q = draft_sample(logits, temperature, generators)
            drafts.append(token_ids.cpu().numpy())
            probs.append(q)
        return self._proposals(request_ids, drafts, probs)
