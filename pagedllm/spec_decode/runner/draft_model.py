"""`DraftModelDrafts`: a second, cheaper model proposes each request's next tokens.

The draft model has its own paged KV cache: a pool of the same blocks as the target's (same
block ids, its own tensors), so it needs no allocation of its own. It computes its KV only
when it proposes, catching up on each request from where its KV is valid to the request's
last token (the whole prompt the first time, then the accepted drafts and the token after
them) in one forward; that forward's last logits give the first draft, and
`num_speculative_tokens - 1` chained single-token steps give the rest, writing the draft's
KV into the lookahead slots the scheduler holds past the request's tokens. Steps that do
not speculate (`disable_by_batch_size`) do not run the draft at all: its KV falls behind and
is caught up later. A preempted request's blocks are new, so its draft KV starts over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from pagedllm.ops.attention import AttentionLayout
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.runner.rejection_sampler import draft_sample
from pagedllm.spec_decode.runner.sampled_drafts import SampledDrafts

if TYPE_CHECKING:
    from pagedllm.runner.compiled_forward import CompiledDecode
    from pagedllm.runner.input_batch import InputBatch


class Spans(NamedTuple):
    """Positions [start, end) of several requests as one flattened forward."""

    metadata: Any  # the attention backend's
    positions: np.ndarray  # per token
    token_row: np.ndarray  # per token: its request's index among the spans
    last_rows: np.ndarray  # per request: its last token's index in the forward


class DraftModelDrafts(SampledDrafts):
    def __init__(
        self,
        config: SpeculativeConfig,
        model: torch.nn.Module,
        attention_backend,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        compiled: CompiledDecode | None = None,
    ) -> None:
        super().__init__(config, device)
        # The chained single-token steps through torch.compile (EngineArgs.compile).
        self.compiled = compiled
        self.model = model
        self.attention_backend = attention_backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        # Request id -> how many of its leading tokens have their draft KV computed.
        self._num_computed: dict[str, int] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._num_computed[request_id] = 0

    def remove_request(self, request_id: str) -> None:
        super().remove_request(request_id)
        self._num_computed.pop(request_id, None)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """The draft's KV of the request is valid for its first `num_tokens` at most (a
        preempted request's is gone; a table cut back lost its tail)."""
        if request_id in self._num_computed:
            self._num_computed[request_id] = min(self._num_computed[request_id], num_tokens)

    def propose(self, request_ids: list[str], batch: InputBatch) -> dict[str, list[int]]:
        self._forget_probs(request_ids)
        if not request_ids or not self.config.speculates(len(request_ids)):
            return {}
        rows = np.array([batch.row(r) for r in request_ids], dtype=np.int64)
        ends = batch.num_tokens[rows]
        starts = np.array([self._num_computed[r] for r in request_ids], dtype=np.int64)
        # Catch up to each request's last token (sampled this step): the first drafts.
        logits = self._forward_spans(batch, rows, starts, ends)
        for request_id, end in zip(request_ids, ends.tolist(), strict=True):
            self._num_computed[request_id] = end

        def next_logits(positions: np.ndarray, token_ids: np.ndarray) -> torch.Tensor:
            return self._forward_spans(batch, rows, positions, positions + 1, token_ids)

        return self._chain_drafts(request_ids, batch, rows, ends, logits, next_logits)

    def _chain_drafts(
        self,
        request_ids: list[str],
        batch: InputBatch,
        rows: np.ndarray,
        ends: np.ndarray,
        logits: torch.Tensor,
        next_logits: Callable[[np.ndarray, np.ndarray], torch.Tensor],
    ) -> dict[str, list[int]]:
        """d1 drawn from `logits` (the catch-up's), then each further draft from
        `next_logits(positions, previous drafts)`: a single-token step per row, its KV
        written at `positions` (the lookahead slots past `ends`)."""
        temperature, generators = self._sampling(batch, rows)
        drafts, probs = [], []
        positions = ends
        for step in range(self.config.num_speculative_tokens):
            token_ids, q = draft_sample(logits, temperature, generators)
            drafts.append(token_ids.cpu().numpy())
            probs.append(q)
            if step + 1 == self.config.num_speculative_tokens:
                break
            # Past the context nothing is verified: the last slot is rewritten instead.
            positions = np.minimum(positions, self.max_model_len - 1)
            logits = next_logits(positions, drafts[-1])
            positions = positions + 1
        return self._proposals(request_ids, drafts, probs)

    def _forward_spans(self, batch: InputBatch, rows, starts, ends, token_ids=None):
        """The tokens at positions [start, end) of each row through the draft (their KV
        written): the logits at each row's last position. `token_ids`: one token per row
        to run instead of the batch's (a draft, not yet one of the request's tokens)."""
        spans = self._spans(batch, rows, starts, ends)
        if token_ids is None:
            token_ids = batch.token_ids[rows[spans.token_row], spans.positions]
        input_ids, positions = self._tensor(token_ids), self._tensor(spans.positions)
        if self.compiled is not None and self.compiled.applies(ends - starts):
            hidden = self.compiled(input_ids, positions, spans.metadata)
        else:
            hidden = self.model(input_ids, positions, spans.metadata)
        return self.model.compute_logits(hidden[self._tensor(spans.last_rows)])

    def _spans(self, batch: InputBatch, rows, starts, ends) -> Spans:
        """The layout of positions [start, end) of each row, flattened, on the draft's KV
        (the rows' block tables: the same blocks as the target's)."""
        counts = ends - starts
        query_start_loc = np.concatenate(([0], np.cumsum(counts)))
        token_row = np.repeat(np.arange(len(rows)), counts)
        positions = starts[token_row] + np.arange(query_start_loc[-1]) - query_start_loc[token_row]
        table = batch.block_table
        num_blocks = int(ends.max() - 1) // self.block_size + 1
        layout = AttentionLayout(
            slot_mapping=table[rows[token_row], positions // self.block_size] * self.block_size
            + positions % self.block_size,
            block_tables=table[rows, :num_blocks],
            query_start_loc=query_start_loc,
            seq_lens=ends,
        )
        metadata = self.attention_backend.build_metadata(layout, self.device)
        return Spans(metadata, positions, token_row, query_start_loc[1:] - 1)
