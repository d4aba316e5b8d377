"""The rejection sampler: greedy prefixes, the target distributions, emitted-token frequencies
against them, seeded reproducibility, and the draft model's draw."""

from __future__ import annotations

import math

import pytest
import torch

import pagedllm.sample.sampler as sampler_module
from pagedllm.sample.sampler import Sampler, SamplingMetadata
from pagedllm.spec_decode.runner.rejection_sampler import (
    draft_sample,
    rejection_sample,
    target_probs,
)


def metadata(
    temperatures: list[float],
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> SamplingMetadata:
    temperature = torch.tensor(temperatures, dtype=torch.float32)
    return SamplingMetadata(
        temperature=temperature,
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.long),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        generators=generators or {},
        all_greedy=bool((temperature == 0).all()),
        all_random=bool((temperature > 0).all()),
    )


def uniform_metadata(num_requests: int, temperature: float, **filters: float) -> SamplingMetadata:
    return metadata(
        [temperature] * num_requests, **{k: [v] * num_requests for k, v in filters.items()}
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Greedy


# Row argmaxes: 2, 0, 4, 1.
GREEDY_ROWS = torch.tensor(
    [
        [0.0, 1.0, 3.0, -1.0, 2.0],
        [5.0, 1.0, 1.0, 0.0, 4.9],
        [0.0, 0.0, 0.0, 0.0, 0.1],
        [-2.0, 7.0, 1.0, 6.0, 3.0],
    ]
)


@pytest.mark.parametrize(
    ("drafts", "expected"),
    [
        ([2, 0, 4], [2, 0, 4, 1]),  # all accepted: the bonus row's argmax follows
        ([3, 0, 4], [2]),  # first rejected: row 0's argmax replaces it
        ([2, 4, 4], [2, 0]),  # middle rejected
        ([2, 0, 3], [2, 0, 4]),  # last rejected
    ],
)
def test_greedy_accepts_the_argmax_prefix(drafts, expected):
    assert rejection_sample(GREEDY_ROWS, [drafts], [None], metadata([0.0])) == [expected]
    # A sampled draft distribution changes nothing for a greedy target.
    q = torch.full((3, 5), 0.2)
    assert rejection_sample(GREEDY_ROWS, [drafts], [q], metadata([0.0])) == [expected]


def test_greedy_without_drafts_is_the_argmax():
    out = rejection_sample(GREEDY_ROWS, [[], [], [], []], [None] * 4, metadata([0.0] * 4))
    assert out == [[2], [0], [4], [1]]


def test_greedy_matches_one_token_at_a_time_in_a_mixed_batch():
    torch.manual_seed(0)
    vocab_size, num_drafts = 50, 6
    logits = torch.randn(4 * (num_drafts + 1), vocab_size).to(torch.bfloat16)
    argmax = Sampler()(logits, uniform_metadata(len(logits), 0.0)).token_ids.view(4, -1)
    # Drafts: the true argmaxes up to a per-request mismatch position (none for request 3).
    drafts = [argmax[r, :num_drafts].tolist() for r in range(4)]
    for r, wrong_at in enumerate([0, 2, 5]):
        drafts[r][wrong_at] = (drafts[r][wrong_at] + 1) % vocab_size
    # A random request in the middle of the batch must not disturb the greedy ones.
    logits = torch.cat([logits[:14], torch.randn(3, vocab_size).to(torch.bfloat16), logits[14:]])
    drafts.insert(2, [1, 2])
    meta = metadata([0.0, 0.0, 0.8, 0.0, 0.0])
    out = rejection_sample(logits, drafts, [None] * 5, meta)
    greedy_out = out[:2] + out[3:]
    for r, wrong_at in enumerate([0, 2, 5, num_drafts]):
        assert greedy_out[r] == argmax[r, : wrong_at + 1].tolist()


# ---------------------------------------------------------------------------------------------
# Target distributions against what Sampler draws


def sampler_distribution(logits_row: torch.Tensor, meta_row: dict, monkeypatch) -> torch.Tensor:
    """Sampler's exact distribution for one row: the share of an even grid of uniforms that
    lands on each token (each share is within 1 / grid size of the token's probability)."""
    grid_size = 4096
    grid = (torch.arange(grid_size, dtype=torch.float32) + 0.5) / grid_size
    monkeypatch.setattr(sampler_module, "uniform_per_row", lambda *args: grid)
    meta = uniform_metadata(grid_size, **meta_row)
    tokens = Sampler()(logits_row.repeat(grid_size, 1), meta).token_ids
    return torch.bincount(tokens, minlength=len(logits_row)).double() / grid_size


TARGET_CASES = [
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 1.5, "min_p": 0.1},
    {"temperature": 0.8, "top_k": 5},
    {"temperature": 1.2, "top_p": 0.7},
    {"temperature": 0.9, "top_k": 9, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.02, "top_k": 10, "top_p": 0.9},
]


@pytest.mark.parametrize("case", TARGET_CASES)
def test_target_probs_is_what_the_sampler_draws_from(case, monkeypatch):
    torch.manual_seed(1)
    logits = torch.randn(16) * 2
    filters = {k: torch.tensor([v]) for k, v in case.items() if k != "temperature"}
    probs = target_probs(logits[None], torch.tensor([case["temperature"]]), **filters)[0]
    expected = sampler_distribution(logits, case, monkeypatch)
    assert torch.allclose(probs.sum(), torch.tensor(1.0))
    # Excluded tokens are never drawn; the grid reaches every token likelier than its step.
    assert not bool(((probs == 0) & (expected > 0)).any()), (probs, expected)
    assert bool((expected[probs > 2 / 4096] > 0).all()), (probs, expected)
    assert (probs.double() - expected).abs().max() <= 1 / 4096 + 1e-6
    if case.keys() != {"temperature"}:
        assert int((probs > 0).sum()) < 16  # the filters did restrict the row


def test_target_probs_of_a_greedy_row_is_one_hot_on_the_argmax():
    logits = torch.tensor([[0.0, 4.0, 1.0], [3.0, 0.0, 1.0]])
    probs = target_probs(logits, torch.tensor([0.0, 1.0]), top_k=torch.tensor([1, 3]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    assert torch.allclose(probs[1], logits[1].softmax(-1))


# ---------------------------------------------------------------------------------------------
# Emitted-token frequencies


VOCAB_SIZE = 8
NUM_TRIALS = 20_000
# Row 0 scores the first token, row 1 the second (after the first draft), row 2 the bonus.
TARGET_ROWS = torch.tensor(
    [
        [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 1.2],
        [-1.0, 0.0, 2.5, 0.3, 1.8, 0.9, -0.2, 0.1],
        [0.5, 0.4, 0.3, 0.2, 0.1, 0.0, -0.1, 2.0],
    ]
)
# Deliberately bad drafts. The sampled one puts 30-40% of its mass on tokens 5 and 6, which
# the target's filters exclude; the deterministic proposals come from an overconfident
# distribution, mostly the target's mode.
TOWARDS_EXCLUDED = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.5, 1.5, 0.0])
SAMPLED_DRAFT_ROWS = 0.5 * TARGET_ROWS[:2] + TOWARDS_EXCLUDED
ONE_HOT_DRAFT_ROWS = 3 * TARGET_ROWS[:2] + 2 * TOWARDS_EXCLUDED
STATISTICAL_CASES = [
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 1.6, "min_p": 0.08, "top_k": 7, "top_p": 0.9},
]


def assert_frequencies_match(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Each token's frequency is within 4.5 standard errors of its probability (a false
    alarm below 7e-6 per token); excluded tokens never appear."""
    num_draws = len(tokens)
    assert num_draws >= 1_000
    freq = torch.bincount(tokens, minlength=VOCAB_SIZE).double() / num_draws
    for token, (f, p) in enumerate(zip(freq.tolist(), probs.tolist(), strict=True)):
        bound = 4.5 * math.sqrt(p * (1 - p) / num_draws)
        assert abs(f - p) <= bound + 1e-12, f"token {token}: frequency {f:.4f} vs p {p:.4f}"


def run_trials(case: dict, sampled_q: bool) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """NUM_TRIALS requests of two drafts each, in one call: (outputs, drafts [N, 2], the
    distributions the drafts were drawn from [2, V])."""
    torch.manual_seed(1234)
    temps = torch.ones(NUM_TRIALS)
    draft_rows = SAMPLED_DRAFT_ROWS if sampled_q else ONE_HOT_DRAFT_ROWS
    steps = [draft_sample(row.repeat(NUM_TRIALS, 1), temps, {}) for row in draft_rows]
    drafts = torch.stack([ids for ids, _ in steps], dim=1)
    q = torch.stack([probs for _, probs in steps], dim=1)  # [N, 2, V]
    # Deterministic proposals: drafts drawn the same way, but passed without q.
    draft_probs = list(q) if sampled_q else [None] * NUM_TRIALS
    logits = TARGET_ROWS.repeat(NUM_TRIALS, 1)
    meta = uniform_metadata(NUM_TRIALS, **case)
    out = rejection_sample(logits, drafts.tolist(), draft_probs, meta)
    return out, drafts, draft_rows.softmax(-1)


@pytest.mark.parametrize("sampled_q", [False, True], ids=["one-hot-q", "sampled-q"])
@pytest.mark.parametrize("case", STATISTICAL_CASES)
def test_emitted_tokens_follow_the_target(case, sampled_q):
    out, drafts, q = run_trials(case, sampled_q)
    filters = {k: torch.tensor([v] * 3) for k, v in case.items() if k != "temperature"}
    p = target_probs(TARGET_ROWS, torch.full((3,), case["temperature"]), **filters).double()
    assert all(1 <= len(tokens) <= 3 for tokens in out)

    first = torch.tensor([tokens[0] for tokens in out])
    assert_frequencies_match(first, p[0])

    # The first draft is accepted with probability sum_x min(p(x), q(x)) for a sampled q;
    # a one-hot q accepts draft x with probability p(x), so on average sum_x q(x) p(x).
    accepted = torch.tensor([len(tokens) >= 2 for tokens in out])
    assert torch.equal(first[accepted], drafts[accepted, 0])
    expected_rate = float(torch.minimum(p[0], q[0]).sum() if sampled_q else (p[0] * q[0]).sum())
    rate = float(accepted.double().mean())
    assert abs(rate - expected_rate) <= 4.5 * math.sqrt(expected_rate / NUM_TRIALS)
    # A draft the target excludes is never kept.
    assert bool((p[0][first[accepted]] > 0).all())

    # Given the first draft was kept, the second token follows row 1, and the bonus row 2.
    second = torch.tensor([tokens[1] for tokens in out if len(tokens) >= 2])
    assert_frequencies_match(second, p[1])
    bonus = torch.tensor([tokens[2] for tokens in out if len(tokens) == 3])
    assert_frequencies_match(bonus, p[2])


def test_drafts_equal_to_the_target_are_always_kept():
    # q = p exactly: every draft passes (u * q < p for u < 1), so each request emits 3 tokens.
    torch.manual_seed(5)
    num_requests = 500
    p = TARGET_ROWS[:2].softmax(-1)
    drafts = torch.stack([torch.multinomial(row, num_requests, True) for row in p], dim=1)
    out = rejection_sample(
        TARGET_ROWS.repeat(num_requests, 1),
        drafts.tolist(),
        [p.clone() for _ in range(num_requests)],
        uniform_metadata(num_requests, 1.0),
    )
    assert all(tokens[:2] == d for tokens, d in zip(out, drafts.tolist(), strict=True))
    assert all(len(tokens) == 3 for tokens in out)


# ---------------------------------------------------------------------------------------------
# Seeded requests


def seeded_request_tokens(seed: int, companions: bool, first: bool) -> list[int]:
    """The tokens of one seeded request (3 drafts, sampled q), alone or among others."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    logits = torch.randn(4, 32, generator=gen) * 2
    draft_logits = logits[:3] + torch.randn(3, 32, generator=gen)
    ids, q = draft_sample(draft_logits, torch.ones(3), {row: gen for row in range(3)})
    # Make the later drafts the target's favourites so that some requests keep several.
    drafts = [ids[0].item(), *logits[1:3].argmax(-1).tolist()]
    request = (logits, drafts, q, 0.9, 0.95, seeded(seed))
    if not companions:
        batch = [request]
    else:
        others = [
            (torch.randn(3, 32), [1, 2], None, 0.7, 1.0, None),
            (torch.randn(1, 32), [], None, 1.1, 0.8, seeded(99)),
            (torch.randn(2, 32), [4], torch.full((1, 32), 1 / 32), 0.0, 1.0, None),
        ]
        batch = [request, *others] if first else [*others, request]
    meta = metadata(
        [b[3] for b in batch],
        top_p=[b[4] for b in batch],
        generators={i: b[5] for i, b in enumerate(batch) if b[5] is not None},
    )
    out = rejection_sample(
        torch.cat([b[0] for b in batch]), [b[1] for b in batch], [b[2] for b in batch], meta
    )
    return out[0] if not companions or first else out[-1]


def test_a_seeded_request_does_not_depend_on_its_companions():
    torch.manual_seed(7)
    outputs = []
    for seed in range(12):
        alone = seeded_request_tokens(seed, companions=False, first=True)
        assert seeded_request_tokens(seed, companions=True, first=True) == alone
        assert seeded_request_tokens(seed, companions=True, first=False) == alone
        outputs.append(alone)
    # The seeds do vary the outcome (different accepted counts among them).
    assert len({len(tokens) for tokens in outputs}) > 1


@pytest.mark.parametrize(
    "filters", [{}, {"top_k": [4]}, {"top_p": [0.6]}, {"min_p": [0.2], "top_k": [6]}]
)
def test_a_request_without_drafts_draws_what_the_sampler_draws(filters):
    torch.manual_seed(3)
    logits = torch.randn(1, 20) * 0.5
    tokens = set()
    for seed in range(20):
        meta = metadata([0.8], generators={0: seeded(seed)}, **filters)
        expected = Sampler()(logits, meta).token_ids.item()
        meta = metadata([0.8], generators={0: seeded(seed)}, **filters)
        assert rejection_sample(logits, [[]], [None], meta) == [[expected]]
        tokens.add(expected)
    assert len(tokens) > 1


# ---------------------------------------------------------------------------------------------
# The draft model's draw and input checks


def test_draft_sample_greedy_rows_are_deterministic_proposals():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    ids, q = draft_sample(logits, torch.zeros(2), {})
    assert ids.tolist() == [1, 0]
    assert q is None
    ids, q = draft_sample(logits, torch.tensor([0.0, 0.5]), {1: seeded(0)})
    assert ids[0].item() == 1
    assert q[0].tolist() == [0.0, 1.0, 0.0]
    assert torch.allclose(q[1], (logits[1] / 0.5).softmax(-1))


def test_draft_sample_is_seeded_and_follows_its_distribution():
    torch.manual_seed(11)
    logits = torch.randn(1, 6)
    first = [draft_sample(logits, torch.ones(1), {0: seeded(s)})[0].item() for s in range(30)]
    again = [draft_sample(logits, torch.ones(1), {0: seeded(s)})[0].item() for s in range(30)]
    assert first == again
    ids, q = draft_sample(logits.repeat(NUM_TRIALS, 1), torch.full((NUM_TRIALS,), 0.7), {})
    probs = (logits[0] / 0.7).softmax(-1).double()
    assert torch.allclose(q[0].double(), probs, atol=1e-6)
    freq = torch.bincount(ids, minlength=6).double() / NUM_TRIALS
    assert bool(((freq - probs).abs() <= 4.5 * (probs * (1 - probs) / NUM_TRIALS).sqrt()).all())


def test_mismatched_shapes_are_rejected():
    meta = metadata([1.0])
    with pytest.raises(ValueError, match="rows"):
        rejection_sample(torch.randn(2, 5), [[1, 2]], [None], meta)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.randn(3, 5), [[1, 2]], [torch.rand(1, 5)], meta)
