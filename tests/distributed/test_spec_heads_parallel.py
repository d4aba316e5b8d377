"""Speculative heads beside a target on several ranks, through the `mp` executor on a tiny
Llama with random heads (tests/eagle_writer.py, tests/medusa_writer.py): the head runs
whole on the sampling rank, reading the target's hidden states (whole on every
tensor-parallel rank after each layer's all-reduce; an EAGLE-3 head's layers carried from
the stage that runs each) and whole copies of its embedding and lm_head (joined from the
ranks' rows, the embedding sent from the first stage). Greedy tokens equal one rank's
without speculation, under chunked prefill and preemption."""

from __future__ import annotations

import pytest
from eagle_writer import write_eagle3_head, write_eagle_head
from medusa_writer import write_vllm_heads
from model_utils import compare_to_reference_engine, greedy_with_logprobs
from parallel_greedy import MAX_TOKENS, SPEC_PROMPTS, TIE_TOLERANCE, budget_llm
from transformers import AutoConfig

# The tiny target has 2 layers: the EAGLE-3 head reads the stream entering each and the last
# layer's output.
AUX_LAYERS = [0, 1, 2]


def write_head(kind: str, target_dir, directory):
    """A head sharing what it can with its target: EAGLE-3 its embedding, EAGLE its
    embedding and lm_head, Medusa its lm_head."""
    target = AutoConfig.from_pretrained(target_dir)
    if kind == "eagle3":
        return write_eagle3_head(directory, target, draft_vocab_size=200, aux_layers=AUX_LAYERS)
    if kind == "eagle":
        return write_eagle_head(directory, target)
    return write_vllm_heads(directory, target, num_heads=3, own_lm_heads=False)


@pytest.mark.parametrize(
    ("method", "layout"),
    [
        ("eagle3", {"tensor_parallel_size": 2}),
        # Tapped layer 0 on the first stage, layers 1 and 2 (the output) on the last.
        ("eagle3", {"pipeline_parallel_size": 2}),
        ("eagle", {"tensor_parallel_size": 2}),
        ("medusa", {"tensor_parallel_size": 2}),
        ("medusa", {"pipeline_parallel_size": 2}),
    ],
    ids=["eagle3-tp2", "eagle3-pp2", "eagle-tp2", "medusa-tp2", "medusa-pp2"],
)
def test_a_head_beside_a_sharded_target_equals_one_rank(
    tiny_llama, tmp_path, plain_one_rank, report_ties, method, layout
):
    head = write_head(method, tiny_llama, tmp_path / method)
    spec = {"method": method, "model": str(head), "num_speculative_tokens": 3}
    draft_kv = head if method != "medusa" else None  # Medusa keeps no KV
    llm = budget_llm(tiny_llama, draft_kv, speculative_config=spec, **layout)
    try:
        actual = greedy_with_logprobs(llm, SPEC_PROMPTS, MAX_TOKENS)
        stats = llm.get_stats()
        assert stats.num_preemptions > 0 and stats.spec_decode.num_drafts > 0
        llm.llm_engine.engine_core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()
    ties, _ = compare_to_reference_engine(plain_one_rank, actual, TIE_TOLERANCE)
    report_ties(ties, len(actual))
