"""benchmarks/spec_decode.py's configuration names (the EAGLE-3 head's k and
disable_by_batch_size, the setting W1 runs with a head on) and its batches of prompts."""

from __future__ import annotations

from benchmarks.spec_decode import batch_of, eagle3_config


def test_eagle3_names_set_k_and_disable_by_batch_size(tmp_path):
    base = {"method": "eagle3", "model": str(tmp_path)}
    assert eagle3_config("eagle3", tmp_path) == {**base, "num_speculative_tokens": 3}
    assert eagle3_config("eagle3_k2", tmp_path) == {**base, "num_speculative_tokens": 2}
    assert eagle3_config("eagle3_d16", tmp_path) == {
        **base,
        "num_speculative_tokens": 3,
        "disable_by_batch_size": 16,
    }
    assert eagle3_config("eagle3_k5_d8", tmp_path)["disable_by_batch_size"] == 8
    assert eagle3_config("ngram", tmp_path) is None
    assert eagle3_config("eagle3_d", tmp_path) is None


def test_a_batch_repeats_the_workloads_prompts_in_order():
    assert batch_of(["a", "b", "c"], 5) == ["a", "b", "c", "a", "b"]
    assert batch_of(["a", "b"], 1) == ["a"]
