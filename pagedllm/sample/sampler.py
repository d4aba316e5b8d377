"""The sampler: one token per row from its logits, vectorized over the batch.

Order (as vLLM): temperature, min_p, top_k, top_p, then a draw. Greedy rows cost one
argmax; a batch of only greedy rows never touches the random path. The draw is
`argmax(probs / q)` with q ~ Exp(1), which samples from `probs`; a seeded row draws its
q from its own generator, so its tokens do not depend on the other rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters, as tensors on the logits' device."""

    temperature: torch.Tensor  # [R] float; 0 = greedy
    top_k: torch.Tensor | None  # [R] long, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [R] float, 1 where disabled; None if no row uses it
    min_p: torch.Tensor | None  # [R] float, 0 where disabled; None if no row uses it
    generators: dict[int, torch.Generator]  # row -> the row's own generator (seeded requests)
    all_greedy: bool
    all_random: bool


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] long
    logprobs: torch.Tensor  # [R] float: log-probability of each token under the raw logits


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        raw_logits: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample from `logits`; logprobs come from `raw_logits` (the model's own) if given."""
        logits = logits.to(torch.float32)
        token_ids = logits.argmax(dim=-1) if metadata.all_greedy else self._sample(logits, metadata)
        raw = logits if raw_logits is None else raw_logits.to(torch.float32)
        chosen = raw.gather(1, token_ids[:, None]).squeeze(1)
        return SamplerOutput(token_ids, chosen - torch.logsumexp(raw, dim=-1))

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = metadata.temperature == 0
        temperature = torch.where(
            greedy, torch.ones_like(metadata.temperature), metadata.temperature
        )
        probs = apply_filters(logits / temperature[:, None], metadata).softmax(dim=-1)
        random_ids = (probs / exponential_like(probs, metadata.generators)).argmax(dim=-1)
        if metadata.all_random:
            return random_ids
        return torch.where(greedy, logits.argmax(dim=-1), random_ids)


def apply_filters(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Mask (to -inf) what min_p, top_k and top_p exclude; rows that disable a filter keep all."""
    if metadata.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * metadata.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if metadata.top_k is None and metadata.top_p is None:
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if metadata.top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        remove |= ranks[None, :] >= metadata.top_k[:, None]
    if metadata.top_p is not None:
        sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # The most likely token is always kept: its mass_before is 0 < top_p.
        remove |= mass_before >= metadata.top_p[:, None]
    return logits.scatter(1, sorted_ids, sorted_logits.masked_fill(remove, float("-inf")))


def exponential_like(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return q
