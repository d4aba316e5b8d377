"""`SampledDrafts`: what every proposer that draws its drafts from a model's logits keeps.

A draft model, an EAGLE head and Medusa heads all draw each draft with `draft_sample`
(argmax for a greedy request, a draw for one that samples) and hold the q of the drafts
proposed last, which the rejection sampler reads back through `draft_probs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.runner.proposer import Proposer

if TYPE_CHECKING:
    from pagedllm.runner.input_batch import InputBatch


class SampledDrafts(Proposer):
    def __init__(self, config: SpeculativeConfig, device: torch.device) -> None:
        super().__init__(config)
        self.device = device
        # q of each request's drafts proposed last, for requests that sample (greedy ones
        # have none); kept until the request next samples, as a step need not schedule
        # every request that holds drafts (a step of prompt chunks alone proposes too).
        self._probs: dict[str, torch.Tensor] = {}

    def remove_request(self, request_id: str) -> None:
        self._probs.pop(request_id, None)

    def _forget_probs(self, request_ids: list[str]) -> None:
        """The requests that sampled this step: their drafts were verified, their q is done."""
        for request_id in request_ids:
            self._probs.pop(request_id, None)

    def _sampling(
        self, batch: InputBatch, rows: np.ndarray
    ) -> tuple[torch.Tensor, dict[int, torch.Generator]]:
        """The rows' temperatures, and the generators of the seeded ones by their index
        among `rows` (what `draft_sample` reads)."""
        temperature = self._tensor(batch.temperature[rows])
        generators = {
            i: batch.generators[row]
            for i, row in enumerate(rows.tolist())
            if row in batch.generators
        }
        return temperature, generators

    def _proposals(
        self,
        request_ids: list[str],
        drafts: list[np.ndarray],
        probs: list[torch.Tensor | None],
    ) -> dict[str, list[int]]:
        """Each request's drafts, step by step in `drafts`; their q kept for `draft_probs`."""
        if probs[0] is not None:  # some request samples
            # Each request's [k, V] in storage of its own: a view of the step's [R, k, V]
            # would keep every request's q alive while one waits (unscheduled, preempted).
            for index, request_id in enumerate(request_ids):
                self._probs[request_id] = torch.stack([step[index] for step in probs])
        proposals = np.stack(drafts, axis=1)
        return dict(zip(request_ids, proposals.tolist(), strict=True))

    def draft_probs(
        self, request_ids: list[str], request_drafts: list[list[int]]
    ) -> list[torch.Tensor | None]:
        """q of each request's drafts as scheduled (a prefix of what was proposed)."""
        return [
            None if (q := self._probs.get(r)) is None else q[: len(drafts)]
            for r, drafts in zip(request_ids, request_drafts, strict=True)
        ]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
