"""What the model runner asks of a proposer, and the model-free ones behind that interface.

The runner tells a proposer which requests it holds (`add_request`, `remove_request`) and,
after each step, asks it for the tokens to follow each request that sampled (`propose`),
from the request's verified tokens in the runner's persistent batch. `draft_probs` gives the
probabilities a proposal was sampled from (None: a deterministic proposal), which the
rejection sampler needs for requests that sample. A proposer that reads the target's hidden
states (an EAGLE or Medusa head) names them (`target_states`) and is handed them after each forward
(`observe_target`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.runner.ngram_proposer import NgramProposer
from pagedllm.spec_decode.runner.suffix_proposer import SuffixProposer

if TYPE_CHECKING:
    import torch

    from pagedllm.runner.input_batch import InputBatch


@dataclass(frozen=True)
class TargetStates:
    """The target's hidden states a proposer reads after every forward, without a second
    pass: `layers` empty, the model's output (after the final norm: EAGLE, Medusa); else the
    residual stream entering those layers, side by side (EAGLE-3; model/hidden_tap.py)."""

    layers: tuple[int, ...] = ()


class Proposer:
    """The interface; the default hooks do nothing (a stateless proposer)."""

    # What `observe_target` is handed (None: it is never called).
    target_states: TargetStates | None = None

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def begin_step(self, speculating: bool) -> None:
        """Before the step's forward: whether the scheduler counted it small enough to
        speculate (`SchedulerOutput.speculating`)."""

    def observe_target(
        self,
        request_ids: list[str],
        first_positions: np.ndarray,
        num_tokens: np.ndarray,
        states: torch.Tensor,
    ) -> None:
        """After every forward of the target (before sampling): `states` [tokens, width]
        of the step's flattened tokens, request i's `num_tokens[i]` rows at positions from
        `first_positions[i]` (drafts the step verifies included: rows past what is
        accepted are not the request's)."""

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        pass

    def remove_request(self, request_id: str) -> None:
        pass

    def propose(self, request_ids: list[str], batch: InputBatch) -> dict[str, list[int]]:
        """Drafts for the requests that sampled this step (none in a step too large to
        speculate: `disable_by_batch_size`). Called after every forward on the sampling
        rank, with no request when none sampled (a step of prompt chunks alone)."""
        if not request_ids or not self.config.speculates(len(request_ids)):
            return {}
        proposals = {}
        for request_id in request_ids:
            row = batch.row(request_id)
            drafts = self.propose_one(request_id, batch.token_ids[row, : batch.num_tokens[row]])
            if drafts:
                proposals[request_id] = drafts
        return proposals

    def propose_one(self, request_id: str, token_ids: np.ndarray) -> list[int]:
        raise NotImplementedError

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """The request's KV is now valid for its first `num_tokens` at most (preempted, or
        its table cut back): a proposer with a KV cache of its own forgets the rest."""

    def draft_probs(
        self, request_ids: list[str], request_drafts: list[list[int]]
    ) -> list[torch.Tensor | None]:
        """Model-free proposals are deterministic: probability 1 on each draft."""
        return [None] * len(request_ids)


class NgramDrafts(Proposer):
    """Prompt lookup: stateless, it reads the request's tokens each time."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.ngram = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def propose_one(self, request_id: str, token_ids: np.ndarray) -> list[int]:
        return self.ngram.propose(token_ids)


class SuffixDrafts(Proposer):
    """Suffix decoding: the tree learns each request's tokens as they are verified, and
    keeps finished requests' outputs for the requests after them."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.suffix = SuffixProposer(
            config.num_speculative_tokens,
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
        )
        # Tokens of each request the tree has seen (a preempted request is re-run by the
        # runner from the same row, so its verified tokens only ever grow).
        self._num_seen: dict[str, int] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.suffix.add_request(request_id, prompt_token_ids)
        self._num_seen[request_id] = len(prompt_token_ids)

    def remove_request(self, request_id: str) -> None:
        if self._num_seen.pop(request_id, None) is not None:
            self.suffix.finish_request(request_id)

    def propose_one(self, request_id: str, token_ids: np.ndarray) -> list[int]:
        seen = self._num_seen[request_id]
        if len(token_ids) > seen:
            self.suffix.extend(request_id, token_ids[seen:].tolist())
            self._num_seen[request_id] = len(token_ids)
        return self.suffix.propose(request_id)


def build_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    """The model-free proposer `config` names; None when the engine does not speculate or a
    draft model proposes (the runner builds that one once its model is loaded)."""
    if config is None:
        return None
    if config.method == "ngram":
        return NgramDrafts(config)
    if config.method == "suffix":
        return SuffixDrafts(config)
    return None
