"""Log-probabilities of chosen tokens under the model's raw distribution, with rank and top-k.

One function serves both sampled tokens (logits of the sampled rows) and prompt tokens
(logits at each prompt position, targets shifted by one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """For each row: the target token's logprob and rank, and the `k` most likely tokens."""

    logprobs: torch.Tensor  # [R] float
    ranks: torch.Tensor  # [R] long, 1 = the most likely token
    top_ids: torch.Tensor  # [R, k] long
    top_logprobs: torch.Tensor  # [R, k] float

    def row(self, index: int, num_top: int) -> tuple[float, int, list[int], list[float]]:
        return (
            float(self.logprobs[index]),
            int(self.ranks[index]),
            self.top_ids[index, :num_top].tolist(),
            self.top_logprobs[index, :num_top].tolist(),
        )


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, num_top: int) -> TokenLogprobs:
    """Logprobs of `target_ids` under `log_softmax(logits)`; `num_top` alternatives per row."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    target = logprobs.gather(1, target_ids[:, None]).squeeze(1)
    ranks = (logprobs > target[:, None]).sum(dim=-1) + 1
    top_logprobs, top_ids = (
        logprobs.topk(num_top, dim=-1)
        if num_top
        else (
            logprobs.new_empty((logits.shape[0], 0)),
            target_ids.new_empty((logits.shape[0], 0)),
        )
    )
    return TokenLogprobs(target, ranks, top_ids, top_logprobs)
