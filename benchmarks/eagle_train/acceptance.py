"""The acceptance length a head gets in the engine, replayed from its held-out accuracy.

The engine drafts only from the positions a verifying step ends on: after a draft is
rejected, the next drafts start right at the token the head missed, so positions are not
drafted from uniformly. Training-time test scores step j at every position p with the
right tokens before it; the engine's j-th draft at p reads exactly those inputs whenever
the drafts before it were accepted (the only case in which it counts). So walking a
sequence as greedy verification does, over the per-position right/wrong of each step,
gives the engine's acceptance on that sequence (tests/bench/test_train_eagle.py pins the
head's drafts to the engine's). `expected_acceptance` in loop.py, which treats every
position alike and the steps as independent, is only an approximation of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.eagle_train.capture import Sequence
from benchmarks.eagle_train.head_model import TrainableEagle3Head


@dataclass
class Replay:
    num_drafts: int = 0  # verifying steps that had drafts
    num_accepted: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """As the engine's metric counts it (spec_decode/metrics.py)."""
        return 1 + self.num_accepted / self.num_drafts if self.num_drafts else 0.0


def replay(
    right: torch.Tensor,
    prompt_len: int,
    num_speculative_tokens: int,
    out: Replay,
    max_output_tokens: int | None = None,
) -> None:
    """Walk one sequence as greedy verification does. `right[j, p]`: step j's draft at
    position p (reading token p + 1) is token p + 2; positions 0 .. len(tokens) - 3. The
    engine drafts no token past `max_output_tokens` (spec_decode/core/scheduling.py)."""
    num_positions = right.shape[1]
    # The prefill samples the first output token; the first drafts read it.
    verified = prompt_len + 1
    while verified - 2 < num_positions:
        base = verified - 2  # the last position with a target state
        num_drafts = min(num_speculative_tokens, right.shape[0])
        if max_output_tokens is not None:
            # The target emits one token after the drafts: none is drafted past the cap.
            num_drafts = min(num_drafts, max_output_tokens - (verified - prompt_len) - 1)
        if num_drafts <= 0:
            return
        accepted = 0
        for step in range(num_drafts):
            if base + step >= num_positions or not bool(right[step, base + step]):
                break
            accepted += 1
        out.num_drafts += 1
        out.num_accepted += accepted
        verified += accepted + 1


@torch.no_grad()
def replayed_acceptance(
    head: TrainableEagle3Head,
    sequences: list[Sequence],
    draft_ids: torch.Tensor,
    num_speculative_tokens: int,
    max_output_tokens: int | None = None,
) -> Replay:
    """The engine's greedy acceptance on `sequences` (the target's own greedy outputs, at
    most `max_output_tokens` each), drafting `num_speculative_tokens` a step with `head`
    (fp32, one sequence at a time)."""
    out = Replay()
    for sequence in sequences:
        tokens = torch.tensor(sequence.token_ids, dtype=torch.long)
        if len(tokens) - 2 <= sequence.prompt_len - 1:
            continue  # at most one output token: nothing is ever drafted
        states = sequence.states[: len(tokens) - 2].float()[None]
        outputs = head(tokens[None, 1:-1], states, num_speculative_tokens)
        labels = draft_ids[tokens[2:]]
        right = torch.stack([head.lm_head(normed[0]).argmax(-1) == labels for normed in outputs])
        replay(right, sequence.prompt_len, num_speculative_tokens, out, max_output_tokens)
    return out
