"""The rejection sampler of speculative decoding, and the draw a draft model proposes with.

A request with drafts d_1..d_n has n + 1 rows of target logits: row i scores the token after
d_i (row 0 the token after the last verified one). Draft i is kept with probability
min(1, p_i(d_i) / q_i(d_i)), where p_i is the distribution the normal `Sampler` would draw
row i - 1 from and q_i the one d_i was proposed from (one-hot for n-gram, suffix and greedy
proposals). The first rejected draft is replaced by a draw from the residual
max(0, p - q) renormalized, and a request that keeps all n drafts gets a bonus token drawn
by the normal `Sampler` from its last row. The emitted tokens are then distributed exactly as
if the target had sampled them one at a time (Leviathan et al. 2023; Chen et al. 2023).
Greedy requests (temperature 0) keep drafts while they equal the argmax, which gives exactly
the tokens greedy decoding would.

Randomness: a request draws n + 1 uniform numbers per call, always in the same order: its n
acceptance tests, then one for the corrected or bonus token. A seeded request draws all of
them from its own generator, so its tokens do not depend on the other requests of the batch;
with n = 0 it draws exactly what the normal `Sampler` would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.ops.fused import inverse_cdf
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection
from pagedllm.sample.sampler import Sampler, SamplingMetadata, apply_min_p, uniform_per_row


def target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """[R, V] float32: the distribution `Sampler` draws each row from (temperature, then
    min_p, top_k, top_p as vLLM); a greedy row (temperature 0) is one-hot on its argmax.

    Dense, and it sorts whole rows where top_k or top_p is given: only the few speculative
    rows of a step come here.
    """
    logits = logits.to(torch.float32)
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    if top_k is not None or top_p is not None:
        scaled = _mask_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    if bool(greedy.any()):
        one_hot = _one_hot(logits.argmax(dim=-1), logits.shape[-1])
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _mask_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """-inf outside the k most likely tokens, then outside the smallest most-likely set whose
    mass (renormalized over the top k) reaches top_p: `sample_candidates`' rule."""
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab_size, device=logits.device).expand_as(logits)
    keep = rank < (top_k[:, None] if top_k is not None else vocab_size)
    if top_p is not None:
        probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        # The most likely token is always kept: its mass before is 0 < top_p.
        keep &= probs.cumsum(dim=-1) - probs < top_p[:, None]
    keep_by_token = torch.empty_like(keep).scatter_(1, sorted_ids, keep)
    return logits.masked_fill(~keep_by_token, float("-inf"))


def _one_hot(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(token_ids, vocab_size).to(torch.float32)


def draft_sample(
    logits: torch.Tensor, temperature: torch.Tensor, generators: dict[int, torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One proposal per row of a draft model's logits [R, V]: (token_ids [R] long, q).

    Greedy rows (temperature 0) take the argmax; random rows draw from
    softmax(logits / temperature) with one uniform each (a seeded row from
    `generators[row]`). q is None when every row is greedy (all proposals deterministic),
    else [R, V] float32: each random row's distribution and a one-hot row for each greedy
    one. Stacking a request's q rows over its n draft steps gives its `draft_probs` entry
    [n, V] for `rejection_sample` (None where every step gave None).
    """
    logits = logits.to(torch.float32)
    greedy = temperature == 0
    argmax = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return argmax, None
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    probs = scaled.softmax(dim=-1)
    uniforms = uniform_per_row(logits.shape[0], generators, logits.device)
    token_ids = torch.where(greedy, argmax, inverse_cdf(probs, uniforms))
    probs = torch.where(greedy[:, None], _one_hot(argmax, logits.shape[-1]), probs)
    return token_ids, probs


@dataclass
class _Layout:
    """Where each request's rows and drafts sit in the flattened batch."""

    num_drafts: list[int]  # per request
    draft_offsets: list[int]  # per request: its first draft's index among all drafts
    draft_rows: torch.Tensor  # [D]: each draft's row in the target logits (the row scoring it)
    draft_requests: torch.Tensor  # [D]: each draft's request
    draft_positions: torch.Tensor  # [D]: each draft's index within its request
    bonus_rows: list[int]  # per request: its last row (scores the token after all drafts)


def _layout(num_drafts: list[int], device: torch.device) -> _Layout:
    row_starts, draft_offsets = [], []
    num_rows = num_drafts_seen = 0
    for n in num_drafts:
        row_starts.append(num_rows)
        draft_offsets.append(num_drafts_seen)
        num_rows += n + 1
        num_drafts_seen += n
    counts = torch.tensor(num_drafts, dtype=torch.long, device=device)
    requests = torch.arange(len(num_drafts), device=device)
    draft_requests = torch.repeat_interleave(requests, counts)
    offsets = torch.tensor(draft_offsets, dtype=torch.long, device=device)
    starts = torch.tensor(row_starts, dtype=torch.long, device=device)
    positions = torch.arange(num_drafts_seen, device=device) - offsets[draft_requests]
    return _Layout(
        num_drafts=num_drafts,
        draft_offsets=draft_offsets,
        draft_rows=starts[draft_requests] + positions,
        draft_requests=draft_requests,
        draft_positions=positions,
        bonus_rows=[start + n for start, n in zip(row_starts, num_drafts, strict=True)],
    )


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    metadata: SamplingMetadata,
    kernels: KernelSelection = TORCH_KERNELS,
) -> list[list[int]]:
    """Per request: its accepted drafts, then one corrected or bonus token (1..n+1 tokens).

    target_logits: [sum(n_r + 1), V], each request's n_r + 1 rows together, requests in
    order, already processed as the normal sampler's input. draft_probs[r]: [n_r, V], the
    distributions request r's drafts were drawn from (`draft_sample`'s q), or None for a
    deterministic proposal. metadata: one row per request. `kernels` picks the bonus draw's
    implementation, as for `Sampler`.
    """
    num_drafts = [len(drafts) for drafts in draft_token_ids]
    _check_shapes(target_logits, num_drafts, draft_probs, metadata)
    device = target_logits.device
    layout = _layout(num_drafts, device)
    accept_uniforms = _acceptance_uniforms(num_drafts, metadata.generators, device)
    num_accepted = [0] * len(num_drafts)
    final_tokens: dict[int, int] = {}
    if layout.draft_rows.numel():
        num_accepted, final_tokens = _verify_drafts(
            target_logits, draft_token_ids, draft_probs, metadata, layout, accept_uniforms
        )
    all_accepted = [r for r, n in enumerate(num_drafts) if num_accepted[r] == n]
    final_tokens.update(_bonus_tokens(target_logits, metadata, layout, all_accepted, kernels))
    return [
        [*drafts[: num_accepted[r]], final_tokens[r]] for r, drafts in enumerate(draft_token_ids)
    ]


def _check_shapes(
    target_logits: torch.Tensor,
    num_drafts: list[int],
    draft_probs: list[torch.Tensor | None],
    metadata: SamplingMetadata,
) -> None:
    num_rows = sum(num_drafts) + len(num_drafts)
    if target_logits.dim() != 2 or target_logits.shape[0] != num_rows:
        raise ValueError(
            f"target_logits {tuple(target_logits.shape)}: expected {num_rows} rows "
            f"(drafts + 1 per request)"
        )
    if len(draft_probs) != len(num_drafts) or metadata.temperature.shape[0] != len(num_drafts):
        raise ValueError("draft_token_ids, draft_probs and metadata need one entry per request")
    vocab_size = target_logits.shape[1]
    for r, (n, probs) in enumerate(zip(num_drafts, draft_probs, strict=True)):
        if probs is not None and tuple(probs.shape) != (n, vocab_size):
            raise ValueError(f"draft_probs[{r}] {tuple(probs.shape)}: expected ({n}, {vocab_size})")


def _acceptance_uniforms(
    num_drafts: list[int], generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """[D] U[0, 1), one per draft; a seeded request draws its own n from its generator."""
    offsets = [0]
    for n in num_drafts:
        offsets.append(offsets[-1] + n)
    uniforms = torch.rand(offsets[-1], device=device)
    for request, generator in generators.items():
        n = num_drafts[request]
        if n:  # no draw at all for n = 0: the bonus draw is then exactly the Sampler's
            start = offsets[request]
            uniforms[start : start + n] = torch.rand(n, generator=generator, device=device)
    return uniforms


def _per_draft(values: torch.Tensor | None, draft_requests: torch.Tensor) -> torch.Tensor | None:
    return None if values is None else values[draft_requests]


def _verify_drafts(
    target_logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    metadata: SamplingMetadata,
    layout: _Layout,
    accept_uniforms: torch.Tensor,
) -> tuple[list[int], dict[int, int]]:
    """(accepted drafts per request, corrected token of each request that rejected one)."""
    device = target_logits.device
    logits = target_logits[layout.draft_rows].to(torch.float32)
    requests = layout.draft_requests
    temperature = metadata.temperature[requests]
    p = target_probs(
        logits,
        temperature,
        _per_draft(metadata.top_k, requests),
        _per_draft(metadata.top_p, requests),
        _per_draft(metadata.min_p, requests),
    )
    drafts = torch.tensor(
        [t for ids in draft_token_ids for t in ids], dtype=torch.long, device=device
    )
    q = _dense_draft_probs(drafts, draft_probs, layout, p.shape[1])
    p_draft = p.gather(1, drafts[:, None]).squeeze(1)
    q_draft = q.gather(1, drafts[:, None]).squeeze(1)
    greedy = temperature == 0
    argmax = logits.argmax(dim=-1)
    # u * q < p accepts with probability min(1, p / q), and never when p = 0.
    accepted = torch.where(greedy, drafts == argmax, accept_uniforms * q_draft < p_draft)
    num_accepted = _accepted_prefix_lengths(accepted, layout)
    rejected = [r for r, n in enumerate(layout.num_drafts) if num_accepted[r] < n]
    if not rejected:
        return num_accepted, {}
    index = torch.tensor(
        [layout.draft_offsets[r] + num_accepted[r] for r in rejected], device=device
    )
    uniforms = uniform_per_row(len(rejected), _renumber(metadata.generators, rejected), device)
    residual_draws = inverse_cdf(_residual(p[index], q[index]), uniforms)
    # Greedy rows take the argmax outright: exactly greedy decoding, whatever the uniforms.
    tokens = torch.where(greedy[index], argmax[index], residual_draws)
    return num_accepted, dict(zip(rejected, tokens.tolist(), strict=True))


def _renumber(
    generators: dict[int, torch.Generator], requests: list[int]
) -> dict[int, torch.Generator]:
    """The generators of `requests`, keyed by each request's index in that list."""
    return {i: generators[r] for i, r in enumerate(requests) if r in generators}


def _dense_draft_probs(
    drafts: torch.Tensor, draft_probs: list[torch.Tensor | None], layout: _Layout, vocab_size: int
) -> torch.Tensor:
    """[D, V]: each draft's q; one-hot on the draft for deterministic proposals."""
    q = _one_hot(drafts, vocab_size)
    given = [probs for probs in draft_probs if probs is not None and len(probs)]
    if given:
        has_probs = torch.tensor([probs is not None for probs in draft_probs], device=q.device)
        # Drafts are in request order, as the concatenated rows.
        q[has_probs[layout.draft_requests]] = torch.cat(given).to(q.device, torch.float32)
    return q


def _accepted_prefix_lengths(accepted: torch.Tensor, layout: _Layout) -> list[int]:
    """Per request: how many of its drafts are kept, i.e. accepted before the first rejection."""
    num_requests = len(layout.num_drafts)
    longest = max(layout.num_drafts)
    # Padding counts as rejected: it only ever follows a request's last draft.
    grid = torch.zeros(num_requests, longest, dtype=torch.long, device=accepted.device)
    grid[layout.draft_requests, layout.draft_positions] = accepted.long()
    return grid.cumprod(dim=1).sum(dim=1).tolist()


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalized (`inverse_cdf` normalizes); p itself where that is all
    zero, which a rejection rules out up to rounding."""
    residual = (p - q).clamp_(min=0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p, residual)


def _bonus_tokens(
    target_logits: torch.Tensor,
    metadata: SamplingMetadata,
    layout: _Layout,
    requests: list[int],
    kernels: KernelSelection,
) -> dict[int, int]:
    """The token after all drafts of each request in `requests`, drawn by the normal
    `Sampler` from the request's last row (its seeded requests' generators included)."""
    if not requests:
        return {}
    rows = torch.tensor([layout.bonus_rows[r] for r in requests], device=target_logits.device)
    sub_metadata = _select_requests(metadata, requests)
    token_ids = Sampler(kernels)(target_logits[rows], sub_metadata, compute_logprobs=False)
    return dict(zip(requests, token_ids.token_ids.tolist(), strict=True))


def _select_requests(metadata: SamplingMetadata, requests: list[int]) -> SamplingMetadata:
    """The metadata of `requests` alone, their rows renumbered in that order."""
    index = torch.tensor(requests, device=metadata.temperature.device)
    temperature = metadata.temperature[index]
    greedy = temperature == 0
    return SamplingMetadata(
        temperature=temperature,
        top_k=None if metadata.top_k is None else metadata.top_k[index],
        top_p=None if metadata.top_p is None else metadata.top_p[index],
        min_p=None if metadata.min_p is None else metadata.min_p[index],
        generators=_renumber(metadata.generators, requests),
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
    )
