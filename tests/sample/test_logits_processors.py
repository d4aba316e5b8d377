"""Logits processors on logits, each checked against a plain per-token reference."""

import random
from collections import Counter

import pytest
import torch

from pagedllm.sample.logits_processors import LogitsProcessorState, apply_logits_processors

VOCAB = 16
NEG_INF = float("-inf")


def reference_row(row: list[float], state: LogitsProcessorState | None) -> list[float]:
    """vLLM's definitions, one token at a time, in vLLM's order."""
    out = list(row)
    if state is None:
        return out
    output = state.output_token_ids
    if state.allowed_token_ids is not None:
        out = [v if t in state.allowed_token_ids else NEG_INF for t, v in enumerate(out)]
    for word in state.bad_words_token_ids or []:
        prefix = word[:-1]
        if not prefix or output[len(output) - len(prefix) :] == prefix:
            out[word[-1]] = NEG_INF
    if len(output) < state.min_tokens:
        for t in [*state.stop_token_ids, *state.eos_token_ids]:
            out[t] = NEG_INF
    for t, bias in (state.logit_bias or {}).items():
        out[t] += bias
    counts = Counter(output)
    for t in range(len(out)):
        if t in state.prompt_token_ids or counts[t] > 0:
            p = state.repetition_penalty
            out[t] = out[t] / p if out[t] > 0 else out[t] * p
        out[t] -= state.frequency_penalty * counts[t]
        if counts[t] > 0:
            out[t] -= state.presence_penalty
    return out


def check_against_reference(before: torch.Tensor, states: list) -> torch.Tensor:
    """Apply and compare: the reference's changed logits within float32 rounding, every other
    logit bit for bit."""
    after = apply_logits_processors(before.clone(), states)
    for i, state in enumerate(states):
        expected = torch.tensor(reference_row(before[i].tolist(), state), dtype=torch.float64)
        unchanged = expected == before[i].double()
        assert torch.equal(after[i][unchanged], before[i][unchanged]), f"row {i}"
        torch.testing.assert_close(after[i].double(), expected, rtol=1e-6, atol=1e-6)
    return after


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=generator) * 3


def state(**options) -> LogitsProcessorState:
    options.setdefault("prompt_token_ids", [1, 2, 2, 9])
    options.setdefault("output_token_ids", [3, 9, 3, 3, 4])
    return LogitsProcessorState(**options)


# Two different settings of each option; rows 0 and 2 use them, rows 1 and 3 do not.
SINGLE_OPTIONS = {
    "repetition_penalty": ({"repetition_penalty": 1.3}, {"repetition_penalty": 0.7}),
    "presence_penalty": ({"presence_penalty": 0.8}, {"presence_penalty": -1.5}),
    "frequency_penalty": ({"frequency_penalty": 0.6}, {"frequency_penalty": -2.0}),
    "logit_bias": ({"logit_bias": {0: 3.0, 5: -2.5}}, {"logit_bias": {15: 100.0}}),
    "allowed_token_ids": ({"allowed_token_ids": [0, 7, 8]}, {"allowed_token_ids": [3]}),
    "bad_words": (
        {"bad_words_token_ids": [[6], [3, 4, 11]]},
        {"bad_words_token_ids": [[9, 3, 12], [0]]},
    ),
    "min_tokens": (
        {"min_tokens": 6, "eos_token_ids": frozenset({15}), "stop_token_ids": [7, 8]},
        {"min_tokens": 100, "eos_token_ids": frozenset({2})},
    ),
}


@pytest.mark.parametrize("option", SINGLE_OPTIONS)
def test_each_option_alone_changes_only_its_rows_and_tokens(option):
    first, second = SINGLE_OPTIONS[option]
    states = [state(**first), None, state(**second), state(), None]
    before = random_logits(len(states))
    after = check_against_reference(before, states)
    for i in (1, 3, 4):
        assert torch.equal(after[i], before[i])
    for i in (0, 2):
        assert not torch.equal(after[i], before[i]), f"{option} changed nothing in row {i}"


def test_repetition_penalty_prompt_only_output_only_both_and_signs():
    # token:          0     1     2     3     4     5     6     7
    row = torch.tensor([[2.0, -2.0, 3.0, -1.0, 4.0, -4.0, 5.0, -5.0]])
    s = state(
        prompt_token_ids=[0, 1, 4, 5], output_token_ids=[2, 3, 4, 5, 4], repetition_penalty=2.0
    )
    after = apply_logits_processors(row.clone(), [s])
    # prompt only: 0, 1; output only: 2, 3; both: 4, 5; neither: 6, 7. Counts do not matter.
    expected = [1.0, -4.0, 1.5, -2.0, 2.0, -8.0, 5.0, -5.0]
    assert after[0].tolist() == expected


def test_presence_counts_once_frequency_counts_every_occurrence():
    row = torch.zeros(3, 4)
    output = [1, 1, 1, 2]
    states = [
        state(output_token_ids=list(output), presence_penalty=0.5),
        state(output_token_ids=list(output), frequency_penalty=0.5),
        state(output_token_ids=list(output), presence_penalty=0.25, frequency_penalty=1.0),
    ]
    after = apply_logits_processors(row.clone(), states)
    assert after.tolist() == [
        [0.0, -0.5, -0.5, 0.0],
        [0.0, -1.5, -0.5, 0.0],
        [0.0, -3.25, -1.25, 0.0],
    ]


@pytest.mark.parametrize(
    ("output", "banned"),
    [
        ([], {3}),  # a multi-token word needs its prefix in the output, not the prompt
        ([5], {3}),
        ([5, 6], {3, 7}),
        ([1, 5, 6], {3, 7}),
        ([5, 6, 1], {3}),
        ([6, 5], {3}),
        ([6], {3}),
        ([1, 6], {3}),  # ends with the prefix's last token only
        ([6, 2], {3, 9}),
    ],
)
def test_bad_words_single_always_multi_only_after_prefix(output, banned):
    s = state(
        prompt_token_ids=[5, 6],
        output_token_ids=list(output),
        bad_words_token_ids=[[3], [5, 6, 7], [2, 9]],
    )
    before = random_logits(1)
    after = check_against_reference(before, [s])
    assert {t for t in range(VOCAB) if after[0, t] == NEG_INF} == banned


def test_min_tokens_masks_eos_and_stop_ids_only_until_reached():
    s = state(
        output_token_ids=[],
        min_tokens=3,
        eos_token_ids=frozenset({15}),
        stop_token_ids=[4, 5],
    )
    before = random_logits(1)
    for step in range(5):
        assert s.needs_processing() == (step < 3)
        after = check_against_reference(before, [s])
        masked = {t for t in range(VOCAB) if after[0, t] == NEG_INF}
        assert masked == ({4, 5, 15} if step < 3 else set())
        s.append_output_token(1)


def test_allowed_token_ids_with_logit_bias():
    s = state(allowed_token_ids=[1, 3, 5], logit_bias={3: 2.0, 4: 5.0})
    before = random_logits(2)
    after = check_against_reference(before, [s, None])
    assert after[0, 3] == before[0, 3] + 2.0
    assert after[0, 1] == before[0, 1] and after[0, 5] == before[0, 5]
    others = [t for t in range(VOCAB) if t not in (1, 3, 5)]
    assert torch.all(after[0, others] == NEG_INF)  # token 4's bias does not revive it
    assert torch.equal(after[1], before[1])


def test_all_options_together_match_reference_in_vllm_order():
    # The bias turns a negative logit positive before the repetition penalty divides it.
    rng = random.Random(3)
    states = []
    for _ in range(6):
        states.append(
            state(
                prompt_token_ids=[rng.randrange(VOCAB) for _ in range(5)],
                output_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randrange(8))],
                repetition_penalty=rng.choice([1.0, 1.4, 0.8]),
                presence_penalty=rng.choice([0.0, 0.7]),
                frequency_penalty=rng.choice([0.0, -0.3]),
                logit_bias={rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(3)},
                allowed_token_ids=rng.choice([None, list(range(0, VOCAB, 2))]),
                bad_words_token_ids=[[rng.randrange(VOCAB)], [1, rng.randrange(VOCAB)]],
                min_tokens=rng.choice([0, 4]),
                eos_token_ids=frozenset({15}),
            )
        )
    check_against_reference(random_logits(len(states) + 1, seed=5), [*states, None])


def test_all_off_batch_returns_same_tensor_untouched():
    off = state()
    reached = state(min_tokens=2, eos_token_ids=frozenset({0}))  # 5 outputs already
    assert not off.needs_processing() and not reached.needs_processing()
    logits = random_logits(3)
    copy = logits.clone()
    assert apply_logits_processors(logits, [off, None, reached]) is logits
    assert torch.equal(logits, copy)


def test_append_output_token_matches_recount():
    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(10)]
    options = {"repetition_penalty": 1.2, "presence_penalty": 0.4, "frequency_penalty": 0.3}
    incremental = LogitsProcessorState(prompt_token_ids=prompt, **options)
    before = random_logits(1, seed=1).repeat(2, 1)
    for step in range(200):
        incremental.append_output_token(rng.randrange(VOCAB))
        if step % 37 == 0:
            scratch = LogitsProcessorState(
                prompt_token_ids=prompt,
                output_token_ids=list(incremental.output_token_ids),
                **options,
            )
            assert incremental.output_token_counts() == Counter(incremental.output_token_ids)
            assert incremental.output_token_counts() == scratch.output_token_counts()
            after = apply_logits_processors(before.clone(), [incremental, scratch])
            assert torch.equal(after[0], after[1])


def test_counts_follow_direct_appends_and_replaced_lists():
    s = state(output_token_ids=[1, 2], frequency_penalty=1.0)
    s.output_token_ids.append(2)  # e.g. a list shared with the request
    assert s.output_token_counts() == {1: 1, 2: 2}
    s.output_token_ids = [4]  # shorter: recounted from scratch
    assert s.output_token_counts() == {4: 1}
    check_against_reference(random_logits(1), [s])


def test_penalties_keep_infinities_and_equal_rows_agree():
    logits = random_logits(3)
    logits[1, 3] = NEG_INF
    logits[2] = logits[1]
    s = state(output_token_ids=[3, 3, 5], repetition_penalty=1.5, frequency_penalty=2.0)
    after = check_against_reference(logits, [None, s, s])
    assert after[1, 3] == NEG_INF and torch.equal(after[1], after[2])
