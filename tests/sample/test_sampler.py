"""The sampler alone: greedy, filters, seeded determinism and sampled frequencies vs softmax."""

import math

import pytest
import torch

from pagedllm.sample.sampler import Sampler, SamplingMetadata

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def metadata(num_rows, temperature=1.0, top_k=None, top_p=None, min_p=None, generators=None):
    def column(value, dtype):
        return None if value is None else torch.full((num_rows,), value, dtype=dtype)

    temps = torch.full((num_rows,), float(temperature))
    return SamplingMetadata(
        temperature=temps,
        top_k=column(top_k, torch.long),
        top_p=column(top_p, torch.float32),
        min_p=column(min_p, torch.float32),
        generators=generators or {},
        all_greedy=temperature == 0,
        all_random=temperature > 0,
    )


def frequencies(num_draws, **kwargs) -> torch.Tensor:
    torch.manual_seed(1234)
    logits = LOGITS.repeat(num_draws, 1)
    tokens = Sampler()(logits, metadata(num_draws, **kwargs)).token_ids
    return torch.bincount(tokens, minlength=len(LOGITS)).double() / num_draws


def assert_matches(freq: torch.Tensor, expected: torch.Tensor, num_draws: int) -> None:
    # Each frequency is within 5 standard errors of its probability (a false alarm
    # chance below 1e-5 per token), and excluded tokens never appear.
    for token, (f, p) in enumerate(zip(freq.tolist(), expected.tolist(), strict=True)):
        bound = 5 * math.sqrt(p * (1 - p) / num_draws) + 1e-12
        assert abs(f - p) <= bound, f"token {token}: frequency {f:.4f} vs probability {p:.4f}"


def test_greedy_is_argmax_and_reports_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 1.0]])
    out = Sampler()(logits, metadata(2, temperature=0))
    assert out.token_ids.tolist() == [1, 0]
    assert torch.allclose(out.logprobs, logits.log_softmax(-1)[[0, 1], [1, 0]])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_frequencies_match_softmax(temperature):
    num_draws = 40_000
    expected = (LOGITS.double() / temperature).softmax(-1)
    assert_matches(frequencies(num_draws, temperature=temperature), expected, num_draws)


def test_top_k_keeps_the_k_most_likely():
    num_draws = 40_000
    expected = torch.zeros(5, dtype=torch.float64)
    expected[:2] = LOGITS[:2].double().softmax(-1)
    assert_matches(frequencies(num_draws, top_k=2), expected, num_draws)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = LOGITS.double().softmax(-1)  # [0.55, 0.20, 0.12, 0.07, 0.03] roughly
    num_draws = 40_000
    top_p = float(probs[:2].sum()) + 0.01  # needs the third token too
    expected = torch.zeros(5, dtype=torch.float64)
    expected[:3] = probs[:3] / probs[:3].sum()
    assert_matches(frequencies(num_draws, top_p=top_p), expected, num_draws)


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = LOGITS.double().softmax(-1)
    num_draws = 40_000
    min_p = 0.3  # keeps tokens with p >= 0.3 * p_max: the first two
    keep = probs >= min_p * probs.max()
    expected = torch.where(keep, probs, 0) / probs[keep].sum()
    assert_matches(frequencies(num_draws, min_p=min_p), expected, num_draws)


def test_top_k_one_is_greedy():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    sampled = Sampler()(logits, metadata(64, temperature=1.3, top_k=1)).token_ids
    assert torch.equal(sampled, logits.argmax(-1))


def test_seeded_row_ignores_its_neighbours():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))

    def draw(rows, seeded_row):
        generator = torch.Generator().manual_seed(7)
        meta = metadata(len(rows), generators={seeded_row: generator})
        return [int(Sampler()(logits[rows], meta).token_ids[seeded_row]) for _ in range(20)]

    alone = draw([3], 0)
    torch.manual_seed(99)
    crowded = draw([0, 1, 3, 5], 2)
    assert alone == crowded
    assert len(set(alone)) > 1  # it really is sampling


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    meta = metadata(4, temperature=1.0)
    meta.temperature = torch.tensor([0.0, 1.0, 0.0, 1.0])
    meta.all_random = False
    out = Sampler()(logits, meta).token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_wide_nucleus_falls_back_to_the_whole_row():
    # A nearly flat distribution over 3000 tokens: top-p 0.9 needs ~2700 of them, more than
    # the partial sort looks at first.
    from pagedllm.sample.sampler import TOP_P_CANDIDATES

    vocab = 3000
    logits = -torch.arange(vocab, dtype=torch.float32) * 1e-4
    probs = logits.double().softmax(-1)
    nucleus = int((probs.cumsum(-1) - probs < 0.9).sum())
    assert nucleus > TOP_P_CANDIDATES
    num_draws = 20_000
    torch.manual_seed(5)
    tokens = Sampler()(logits.repeat(num_draws, 1), metadata(num_draws, top_p=0.9)).token_ids
    assert int(tokens.max()) < nucleus
    assert int(tokens.max()) > TOP_P_CANDIDATES  # the fallback really sampled past them
    # Mass of the first half of the nucleus, renormalized, within 5 standard errors.
    half = probs[: nucleus // 2].sum() / probs[:nucleus].sum()
    frequency = float((tokens < nucleus // 2).double().mean())
    assert abs(frequency - float(half)) <= 5 * math.sqrt(float(half * (1 - half)) / num_draws)


def test_top_k_with_top_p_and_min_p_together():
    num_draws = 40_000
    probs = LOGITS.double().softmax(-1)
    # top_k 3 keeps [0, 1, 2]; top_p 0.8 of those keeps [0, 1] (0.55+0.20 < 0.8 of 0.87).
    top3 = probs[:3] / probs[:3].sum()
    keep = (top3.cumsum(-1) - top3) < 0.8
    expected = torch.zeros(5, dtype=torch.float64)
    expected[:3] = torch.where(keep, top3, 0) / top3[keep].sum()
    assert_matches(frequencies(num_draws, top_k=3, top_p=0.8), expected, num_draws)


def test_logprobs_are_skipped_unless_asked():
    logits = torch.randn(3, 10)
    out = Sampler()(logits, metadata(3, temperature=0), compute_logprobs=False)
    assert out.logprobs is None and out.token_ids.tolist() == logits.argmax(-1).tolist()
