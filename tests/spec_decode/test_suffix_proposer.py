"""Tests for the suffix-decoding proposer: hand-computed proposals (per-request and global
matching, probability and length limits), the bounded global cache, incremental updates,
and randomized comparisons of the trie and the drafts with brute-force references."""

import random
from collections.abc import Sequence

import pytest

from pagedllm.spec_decode.runner.suffix_proposer import SuffixProposer, _SuffixTrie


def _proposer(**overrides: object) -> SuffixProposer:
    options: dict = dict(
        num_speculative_tokens=8,
        max_tree_depth=8,
        max_cached_requests=0,
        max_spec_factor=1.0,
        min_token_prob=0.1,
    )
    options.update(overrides)
    return SuffixProposer(**options)


def _run_request(
    proposer: SuffixProposer, request_id: str, prompt: list[int], output: list[int]
) -> None:
    proposer.add_request(request_id, prompt)
    for token in output:
        proposer.extend(request_id, [token])
    proposer.finish_request(request_id)


# -- brute-force references ----------------------------------------------------------------


def _substring_counts(sequences: Sequence[Sequence[int]], max_depth: int) -> dict:
    counts: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + max_depth, len(seq)) + 1):
                key = tuple(seq[start:end])
                counts[key] = counts.get(key, 0) + 1
    return counts


def _reference_draft(
    sequences: Sequence[Sequence[int]],
    pattern: Sequence[int],
    max_depth: int,
    cap: int,
    factor: float,
    min_prob: float,
) -> tuple[list[int], float]:
    """Arctic Inference's path speculation, written plainly: every match length in
    ascending order, the later (longer) match winning ties."""
    counts = _substring_counts(sequences, max_depth)
    best: tuple[list[int], float] = ([], 0.0)
    for match_len in range(1, min(len(pattern), max_depth - 1) + 1):
        context = tuple(pattern[len(pattern) - match_len :])
        if context not in counts:
            break
        budget = min(cap, int(match_len * factor + 1e-6))
        tokens: list[int] = []
        score, prob = 0.0, 1.0
        while len(tokens) < budget:
            children = [
                (count, key[-1])
                for key, count in counts.items()
                if len(key) == len(context) + 1 and key[:-1] == context
            ]
            if not children:
                break
            count, token = min(children, key=lambda item: (-item[0], item[1]))
            prob *= count / counts[context]
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            context = (*context, token)
        if score >= best[1]:
            best = (tokens, score)
    return best


# -- per-request matching ------------------------------------------------------------------


def test_per_request_match_continues_the_earlier_occurrence() -> None:
    proposer = _proposer(max_spec_factor=1.0)
    proposer.add_request("r", [1, 2, 3, 4, 5, 9, 1, 2])
    # [1, 2] occurs twice (once as the current end): 3 follows with probability 1/2, and
    # a two-token match allows two tokens.
    assert proposer.propose("r") == [3, 4]


def test_max_spec_factor_limits_the_length() -> None:
    prompt = [1, 2, 3, 4, 5, 9, 1, 2]
    for factor, expected in [(0.5, [3]), (1.0, [3, 4]), (2.0, [3, 4, 5, 9]), (0.0, [])]:
        proposer = _proposer(max_spec_factor=factor)
        proposer.add_request("r", prompt)
        assert proposer.propose("r") == expected, factor


def test_num_speculative_tokens_and_call_cap_limit_the_length() -> None:
    proposer = _proposer(num_speculative_tokens=3, max_spec_factor=4.0)
    proposer.add_request("r", [1, 2, 3, 4, 5, 9, 1, 2])
    assert proposer.propose("r") == [3, 4, 5]
    assert proposer.propose("r", max_spec_tokens=2) == [3, 4]
    assert proposer.propose("r", max_spec_tokens=0) == []


def test_max_tree_depth_bounds_match_plus_draft() -> None:
    # Depth 3: the match [1, 2] leaves room for [3] (score 1/2), the match [2] for [3, 4]
    # (score 1). Depth 4: [2] has room for [3, 4, 5] (score 3/2). Depth 8: [1, 2] for six.
    for depth, expected in [(3, [3, 4]), (4, [3, 4, 5]), (8, [3, 4, 5, 9, 1, 2])]:
        proposer = _proposer(max_tree_depth=depth, max_spec_factor=4.0)
        proposer.add_request("r", [1, 2, 3, 4, 5, 9, 1, 2])
        assert proposer.propose("r") == expected, depth


def test_min_token_prob_cuts_the_branch_on_the_path_probability() -> None:
    # [1] occurs 4 times: followed by 5 twice (p = 1/2), then [1, 5] -> 1 always (1/2),
    # then [1, 5, 1] -> 5 or 6 once each (the smaller token wins the tie; 1/4), ...
    prompt = [1, 5, 1, 5, 1, 6, 1]
    expected = {0.1: [5, 1, 5, 1, 6, 1], 0.25: [5, 1, 5, 1, 6, 1], 0.3: [5, 1], 0.5: [5, 1]}
    for min_prob, draft in expected.items():
        proposer = _proposer(max_spec_factor=8.0, min_token_prob=min_prob)
        proposer.add_request("r", prompt)
        assert proposer.propose("r") == draft, min_prob
    strict = _proposer(max_spec_factor=8.0, min_token_prob=0.6)
    strict.add_request("r", prompt)
    assert strict.propose("r") == []


def test_no_match_gives_nothing() -> None:
    proposer = _proposer(max_cached_requests=10)
    proposer.add_request("r", [1, 2, 3, 4])
    assert proposer.propose("r") == []
    proposer.add_request("empty", [])
    assert proposer.propose("empty") == []


def test_output_tokens_extend_the_request_trie() -> None:
    proposer = _proposer()
    proposer.add_request("r", [4, 5, 6, 7])
    assert proposer.propose("r") == []
    proposer.extend("r", [4, 5])
    assert proposer.propose("r") == [6, 7]


# -- global cache --------------------------------------------------------------------------


def test_second_request_with_the_same_prompt_drafts_the_first_output() -> None:
    prompt, output = [100, 101, 102], [7, 8, 9, 10, 11]
    proposer = _proposer(max_cached_requests=10, max_spec_factor=4.0, num_speculative_tokens=4)
    _run_request(proposer, "a", prompt, output)
    proposer.add_request("b", prompt)
    proposer.extend("b", [7])
    # [7] occurs in a's output and (live) in b's: 8 follows with probability 1/2.
    assert proposer.propose("b") == [8, 9, 10, 11]
    proposer.extend("b", [8])
    assert proposer.propose("b") == [9, 10, 11]

    without_cache = _proposer(max_cached_requests=0, max_spec_factor=4.0)
    _run_request(without_cache, "a", prompt, output)
    without_cache.add_request("b", prompt)
    without_cache.extend("b", [7])
    assert without_cache.propose("b") == []


def test_running_requests_draft_from_each_other() -> None:
    proposer = _proposer(max_cached_requests=10, max_spec_factor=4.0)
    proposer.add_request("a", [1])
    proposer.add_request("b", [2])
    proposer.extend("a", [30, 31, 32])
    proposer.extend("b", [30])
    assert proposer.propose("b") == [31, 32]


def test_global_draft_must_score_strictly_higher_than_the_local_one() -> None:
    proposer = _proposer(max_cached_requests=10)
    _run_request(proposer, "a", [0], [7, 8])
    proposer.add_request("b", [7, 9, 5])
    proposer.extend("b", [7])
    # Locally 9 follows [7] with p = 1/2; globally 8 does, also with p = 1/2: a tie.
    assert proposer.propose("b") == [9]

    proposer = _proposer(max_cached_requests=10)
    _run_request(proposer, "a", [0], [7, 8, 7, 8])
    proposer.add_request("b", [7, 9, 5])
    proposer.extend("b", [7])
    # Globally [7] occurs 3 times, twice followed by 8: p = 2/3 beats 1/2.
    assert proposer.propose("b") == [8]


def test_eviction_keeps_the_newest_outputs_and_restores_node_counts() -> None:
    rng = random.Random(3)
    outputs = [[rng.randrange(50) for _ in range(30)] for _ in range(6)]
    proposer = _proposer(max_cached_requests=2)
    for index, output in enumerate(outputs):
        _run_request(proposer, f"r{index}", [999], output)
    assert proposer.cached_requests == ["r4", "r5"]

    fresh = _proposer(max_cached_requests=2)
    for index in (4, 5):
        _run_request(fresh, f"r{index}", [999], outputs[index])
    assert proposer.num_cached_nodes() == fresh.num_cached_nodes() > 0
    for output in outputs:
        for start in range(len(output)):
            for end in range(start + 1, min(start + 8, len(output)) + 1):
                piece = output[start:end]
                assert proposer.cached_count(piece) == fresh.cached_count(piece)
    # Evicted outputs are gone (an 8-gram over 50 tokens does not recur by chance).
    assert proposer.cached_count(outputs[0][:8]) == 0
    assert proposer.cached_count(outputs[5][:8]) == 1


def test_evicting_everything_frees_every_node() -> None:
    proposer = _proposer(max_cached_requests=1)
    _run_request(proposer, "a", [1], [5, 6, 7, 5, 6, 8])
    nodes_with_a = proposer.num_cached_nodes()
    assert nodes_with_a > 0
    _run_request(proposer, "b", [1], [])
    assert proposer.cached_requests == ["b"]
    assert proposer.num_cached_nodes() == 0
    assert proposer.cached_count([5]) == 0


def test_adding_a_request_takes_a_cache_slot_and_evicts_fifo() -> None:
    proposer = _proposer(max_cached_requests=2)
    proposer.add_request("a", [1])
    proposer.extend("a", [3, 4])
    proposer.add_request("b", [1])
    proposer.add_request("c", [1])  # evicts a's output although a is still running
    assert proposer.cached_requests == ["b", "c"]
    proposer.extend("a", [3, 4])
    assert proposer.cached_count([3]) == 0
    assert proposer.propose("a") == [3, 4]  # from its own trie over [1, 3, 4, 3, 4]


def test_abort_drops_the_output_and_finish_keeps_it() -> None:
    proposer = _proposer(max_cached_requests=10)
    proposer.add_request("done", [1])
    proposer.extend("done", [5, 6])
    proposer.finish_request("done")
    proposer.add_request("gone", [1])
    proposer.extend("gone", [7, 8])
    proposer.abort_request("gone")
    assert proposer.cached_requests == ["done"]
    assert proposer.cached_count([5, 6]) == 1
    assert proposer.cached_count([7]) == 0
    assert proposer.active_requests == []


def test_reusing_a_finished_id_replaces_its_cached_output() -> None:
    proposer = _proposer(max_cached_requests=10)
    _run_request(proposer, "r", [1], [5, 6])
    proposer.add_request("r", [1])
    assert proposer.cached_count([5]) == 0
    proposer.extend("r", [9])
    assert proposer.cached_requests == ["r"]
    assert proposer.cached_count([9]) == 1


# -- incremental updates -------------------------------------------------------------------


def test_extend_in_chunks_equals_one_token_at_a_time() -> None:
    rng = random.Random(11)
    one_by_one = _proposer(max_cached_requests=3, max_spec_factor=2.0)
    chunked = _proposer(max_cached_requests=3, max_spec_factor=2.0)
    for request in range(5):
        request_id = f"r{request}"
        prompt = [rng.randrange(6) for _ in range(rng.randrange(0, 12))]
        output = [rng.randrange(6) for _ in range(40)]
        one_by_one.add_request(request_id, prompt)
        chunked.add_request(request_id, prompt)
        position = 0
        while position < len(output):
            chunk = output[position : position + rng.randrange(1, 6)]
            position += len(chunk)
            for token in chunk:
                one_by_one.extend(request_id, [token])
            chunked.extend(request_id, chunk)
            assert chunked.propose(request_id) == one_by_one.propose(request_id)
        one_by_one.finish_request(request_id)
        chunked.finish_request(request_id)
    assert chunked.num_cached_nodes() == one_by_one.num_cached_nodes()


@pytest.mark.parametrize("seed", range(3))
def test_trie_counts_equal_brute_force_substring_counts(seed: int) -> None:
    rng = random.Random(seed)
    max_depth = rng.choice([1, 3, 5])
    trie = _SuffixTrie(max_depth)
    live: dict[int, list[int]] = {}
    next_key = 0
    for _ in range(60):
        action = rng.random()
        if action < 0.25 or not live:
            trie.open(next_key)
            live[next_key] = []
            next_key += 1
        elif action < 0.4:
            key = rng.choice(list(live))
            trie.remove(key)
            del live[key]
        else:
            key = rng.choice(list(live))
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 7))]
            trie.extend(key, tokens)
            live[key].extend(tokens)
        expected = _substring_counts(list(live.values()), max_depth)
        assert trie.num_nodes() == len(expected)
        for substring, count in expected.items():
            assert trie.count(substring) == count
        assert trie.count([]) == sum(len(seq) for seq in live.values())


@pytest.mark.parametrize("seed", range(4))
def test_drafts_equal_the_reference_speculation(seed: int) -> None:
    rng = random.Random(100 + seed)
    depth = rng.choice([3, 5, 8])
    k = rng.randrange(1, 7)
    factor = rng.choice([0.5, 1.0, 1.5, 3.0])
    min_prob = rng.choice([0.0, 0.1, 0.3, 0.6])
    proposer = _proposer(
        num_speculative_tokens=k,
        max_tree_depth=depth,
        max_cached_requests=3,
        max_spec_factor=factor,
        min_token_prob=min_prob,
    )
    outputs: dict[str, list[int]] = {}
    for request in range(6):
        request_id = f"r{request}"
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 10))]
        proposer.add_request(request_id, tokens)
        outputs[request_id] = []
        for _ in range(25):
            new = [rng.randrange(4) for _ in range(rng.randrange(1, 3))]
            proposer.extend(request_id, new)
            tokens += new
            outputs[request_id] += new
            cached = [outputs[key] for key in proposer.cached_requests]
            local, local_score = _reference_draft([tokens], tokens, depth, k, factor, min_prob)
            shared, shared_score = _reference_draft(cached, tokens, depth, k, factor, min_prob)
            expected = shared if shared_score > local_score else local
            assert proposer.propose(request_id) == expected
        proposer.finish_request(request_id)


# -- errors --------------------------------------------------------------------------------


def test_unknown_and_duplicate_request_ids() -> None:
    proposer = _proposer()
    with pytest.raises(KeyError):
        proposer.extend("nope", [1])
    with pytest.raises(KeyError):
        proposer.propose("nope")
    with pytest.raises(KeyError):
        proposer.finish_request("nope")
    proposer.add_request("r", [1])
    with pytest.raises(ValueError, match="already active"):
        proposer.add_request("r", [1])
    proposer.finish_request("r")
    with pytest.raises(KeyError):
        proposer.propose("r")


def test_rejects_out_of_range_token_ids() -> None:
    proposer = _proposer()
    with pytest.raises(ValueError, match="token ids"):
        proposer.add_request("r", [1, -1])
    assert proposer.active_requests == []
    proposer.add_request("r", [1])
    with pytest.raises(ValueError, match="token ids"):
        proposer.extend("r", [1 << 40])


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 1.5}, "num_speculative_tokens"),
        ({"max_tree_depth": 0}, "max_tree_depth"),
        ({"max_cached_requests": -1}, "max_cached_requests"),
        ({"max_cached_requests": True}, "max_cached_requests"),
        ({"max_spec_factor": -0.5}, "max_spec_factor"),
        ({"max_spec_factor": float("inf")}, "max_spec_factor"),
        ({"max_spec_factor": float("nan")}, "max_spec_factor"),
        ({"min_token_prob": 1.5}, "min_token_prob"),
        ({"min_token_prob": -0.1}, "min_token_prob"),
        ({"min_token_prob": "0.1"}, "min_token_prob"),
    ],
)
def test_constructor_validation_names_the_argument(overrides: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        _proposer(**overrides)


def test_defaults_match_vllm() -> None:
    proposer = SuffixProposer(num_speculative_tokens=24)
    assert proposer.max_tree_depth == 24
    assert proposer.max_cached_requests == 10000
    assert proposer.max_spec_factor == 1.0
    assert proposer.min_token_prob == 0.1
