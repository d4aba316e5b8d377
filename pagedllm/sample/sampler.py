"""The sampler: one token per row from its logits, vectorized over the batch.

Order (as vLLM): temperature, min_p, top_k, top_p, then a draw. Greedy rows cost one
argmax; a batch of only greedy rows never touches the random path. Top-k and top-p work on
the few most likely tokens found by a partial sort (`topk`), not a sort of the vocabulary.
The draw is an inverse-CDF lookup with one uniform number per row; a seeded row draws it
from its own generator, so its tokens do not depend on the other rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.ops.fused import greedy_pick, inverse_cdf, sample_plain
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection


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
    # [R] float: log-probability of each token under the raw logits (None if not asked)
    logprobs: torch.Tensor | None


# Top-p alone first looks at this many most likely tokens; a row whose nucleus is wider
# (only a very flat distribution) falls back to sorting its whole row.
TOP_P_CANDIDATES = 1024


class Sampler:
    def __init__(self, kernels: KernelSelection = TORCH_KERNELS) -> None:
        # The plain draw (no top-k/top-p/min-p) runs in the C++ kernel where `kernels` says.
        self.kernels = kernels

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        raw_logits: torch.Tensor | None = None,
        compute_logprobs: bool = True,
    ) -> SamplerOutput:
        """Sample from `logits`; logprobs come from `raw_logits` (the model's own) if given,
        and only when `compute_logprobs` (a logsumexp over the vocabulary is not free)."""
        logits = logits.to(torch.float32)
        if metadata.all_greedy:
            token_ids = greedy_pick(logits, self.kernels)
        else:
            token_ids = self._sample(logits, metadata)
        if not compute_logprobs:
            return SamplerOutput(token_ids, None)
        raw = logits if raw_logits is None else raw_logits.to(torch.float32)
        chosen = raw.gather(1, token_ids[:, None]).squeeze(1)
        return SamplerOutput(token_ids, chosen - torch.logsumexp(raw, dim=-1))

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = metadata.temperature == 0
        temperature = torch.where(
            greedy, torch.ones_like(metadata.temperature), metadata.temperature
        )
        uniforms = uniform_per_row(logits.shape[0], metadata.generators, logits.device)
        if metadata.min_p is None and metadata.top_k is None and metadata.top_p is None:
            # Temperature folded into the draw: no scaled copy of the logits.
            random_ids = sample_plain(logits, 1.0 / temperature, uniforms, self.kernels)
        else:
            scaled = logits / temperature[:, None]
            if metadata.min_p is not None:
                scaled = apply_min_p(scaled, metadata.min_p)
            random_ids = sample_filtered(
                scaled, metadata.top_k, metadata.top_p, uniforms, self.kernels
            )
        if metadata.all_random:
            return random_ids
        return torch.where(greedy, greedy_pick(logits, self.kernels), random_ids)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the best: p_i < min_p * p_max is
    logit_i < logit_max + log(min_p), so no softmax is needed (log 0 = -inf keeps all)."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def sample_filtered(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    uniforms: torch.Tensor,
    kernels: KernelSelection = TORCH_KERNELS,
) -> torch.Tensor:
    """One token per row from softmax(logits) restricted by top-k then top-p."""
    num_rows, vocab_size = logits.shape
    k = top_k if top_k is not None else torch.full((num_rows,), vocab_size, device=logits.device)
    p = top_p if top_p is not None else torch.ones(num_rows, device=logits.device)
    filtered = (k < vocab_size) | (p < 1)
    token_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    plain = (~filtered).nonzero().squeeze(1)
    if len(plain):
        ones = torch.ones(len(plain), device=logits.device)
        token_ids[plain] = sample_plain(logits[plain], ones, uniforms[plain], kernels)
    rows = filtered.nonzero().squeeze(1)
    if len(rows):
        token_ids[rows] = sample_candidates(logits[rows], k[rows], p[rows], uniforms[rows])
    return token_ids


def sample_candidates(
    logits: torch.Tensor,
    k: torch.Tensor,
    p: torch.Tensor,
    uniforms: torch.Tensor,
    num_candidates: int | None = None,
) -> torch.Tensor:
    """Top-k / top-p sampling over the few most likely tokens (a partial sort, not a full one)."""
    vocab_size = logits.shape[-1]
    if num_candidates is None:
        bounded = k[k < vocab_size]
        wanted = int(bounded.max()) if len(bounded) else 0
        if bool((p < 1).any()):
            wanted = max(wanted, TOP_P_CANDIDATES)
        num_candidates = min(vocab_size, wanted)
    values, ids = logits.topk(num_candidates, dim=-1)  # sorted, most likely first
    keep = torch.arange(num_candidates, device=logits.device)[None, :] < k[:, None]
    # Probabilities over what top-k keeps: the candidates hold all of it when k fits among
    # them; otherwise (top-p alone) normalize over the whole row.
    within = k <= num_candidates
    log_total = torch.logsumexp(values.masked_fill(~keep, float("-inf")), dim=-1)
    if not bool(within.all()):
        log_total[~within] = torch.logsumexp(logits[~within], dim=-1)
    probs = (values - log_total[:, None]).exp().masked_fill(~keep, 0.0)
    mass_before = probs.cumsum(dim=-1) - probs
    # The most likely token is always kept: its mass_before is 0 < top_p.
    keep &= mass_before < p[:, None]
    choice = inverse_cdf(probs.masked_fill(~keep, 0.0), uniforms)
    token_ids = ids.gather(1, choice[:, None]).squeeze(1)
    wider = ~within & (probs.sum(dim=-1) < p)  # the nucleus reaches past the candidates
    if bool(wider.any()):
        token_ids[wider] = sample_candidates(
            logits[wider], k[wider], p[wider], uniforms[wider], num_candidates=vocab_size
        )
    return token_ids


def uniform_per_row(
    num_rows: int, generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """U[0, 1) per row; a seeded row draws from its own generator, so other rows cannot
    change what it samples."""
    uniforms = torch.rand(num_rows, device=device)
    for row, generator in generators.items():
        uniforms[row] = torch.rand(1, generator=generator, device=device)[0]
    return uniforms
