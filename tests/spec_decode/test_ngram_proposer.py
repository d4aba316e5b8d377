"""Tests for the prompt-lookup (n-gram) proposer: exact proposals on hand-written sequences,
a randomized comparison with a brute-force search, and argument validation."""

import numpy as np
import pytest

from pagedllm.spec_decode.runner.ngram_proposer import NgramProposer


def _propose(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    return NgramProposer(k, low, high).propose(np.array(tokens, dtype=np.int64))


def _brute_force(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """Longest n first; earliest occurrence that ends before the last token."""
    total = len(tokens)
    for n in range(high, low - 1, -1):
        if n > total - 1:
            continue
        suffix = tokens[total - n :]
        for start in range(total - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_vllm_docstring_example() -> None:
    # [4, 2, 3] has no earlier occurrence; [2, 3] does, followed by only 3 tokens.
    assert _propose([1, 2, 3, 4, 2, 3], k=4, low=2, high=3) == [4, 2, 3]


def test_longest_match_wins_over_earlier_shorter_match() -> None:
    tokens = [5, 2, 3, 8, 1, 2, 3, 6, 1, 2, 3]
    # [2, 3] alone would match first at index 1 and propose [8, 1].
    assert _propose(tokens, k=2, low=1, high=3) == [6, 1]
    assert _propose(tokens, k=2, low=1, high=2) == [8, 1]


def test_earliest_occurrence_of_the_longest_ngram() -> None:
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert _propose(tokens, k=1, low=2, high=2) == [7]
    assert _propose(tokens, k=4, low=2, high=2) == [7, 1, 2, 8]


def test_max_bound_caps_the_match_length() -> None:
    tokens = [2, 3, 4, 7, 1, 2, 3, 4, 9, 1, 2, 3, 4]
    assert _propose(tokens, k=2, low=1, high=4) == [9, 1]
    # Capped at 3, [2, 3, 4] first occurs at the very start.
    assert _propose(tokens, k=2, low=1, high=3) == [7, 1]


def test_min_bound_rejects_short_matches() -> None:
    tokens = [1, 5, 6, 1]
    assert _propose(tokens, k=2, low=2, high=3) == []
    assert _propose(tokens, k=2, low=1, high=3) == [5, 6]


def test_fewer_tokens_when_the_sequence_ends_first() -> None:
    assert _propose([1, 2, 3, 1, 2], k=5, low=2, high=2) == [3, 1, 2]


def test_occurrence_may_overlap_the_final_ngram() -> None:
    # [7, 7] first occurs at 0..1; it ends before the last token, so it counts.
    assert _propose([7, 7, 7, 7], k=3, low=2, high=2) == [7, 7]
    assert _propose([7, 7, 7, 7], k=3, low=3, high=3) == [7]
    assert _propose([7, 7, 7, 7], k=3, low=4, high=4) == []


def test_no_match_and_short_sequences() -> None:
    assert _propose([1, 2, 3, 4], k=3, low=1, high=3) == []
    assert _propose([5], k=3, low=1, high=1) == []
    assert _propose([], k=3, low=1, high=1) == []
    assert _propose([5, 5], k=3, low=1, high=1) == [5]


def test_accepts_int32_arrays_and_lists() -> None:
    proposer = NgramProposer(2, 1, 2)
    assert proposer.propose(np.array([3, 4, 5, 3], dtype=np.int32)) == [4, 5]
    assert proposer.propose([3, 4, 5, 3]) == [4, 5]  # type: ignore[arg-type]
    result = proposer.propose(np.array([3, 4, 5, 3]))
    assert all(type(token) is int for token in result)


def test_rejects_multidimensional_input() -> None:
    with pytest.raises(ValueError, match="1-D"):
        NgramProposer(2, 1, 2).propose(np.zeros((2, 3), dtype=np.int64))


def test_long_sequence_copies_the_repeated_span() -> None:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 32000, 4000)
    tokens[-5:] = tokens[1000:1005]
    proposer = NgramProposer(6, 2, 5)
    assert proposer.propose(tokens) == tokens[1005:1011].tolist()


@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force_on_random_sequences(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(150):
        length = int(rng.integers(0, 40))
        vocab = int(rng.integers(2, 5))
        tokens = rng.integers(0, vocab, length).tolist()
        low = int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        expected = _brute_force(tokens, k, low, high)
        assert _propose(tokens, k, low, high) == expected, (tokens, k, low, high)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0, 1, 2), "num_speculative_tokens"),
        ((-1, 1, 2), "num_speculative_tokens"),
        ((2.0, 1, 2), "num_speculative_tokens"),
        ((True, 1, 2), "num_speculative_tokens"),
        ((2, 0, 2), "prompt_lookup_min"),
        ((2, 1, 0), "prompt_lookup_max"),
        ((2, 1, "3"), "prompt_lookup_max"),
        ((2, 3, 2), "prompt_lookup_min"),
    ],
)
def test_constructor_validation_names_the_argument(args: tuple, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        NgramProposer(*args)
