"""Tensor and pipeline parallelism through the `mp` executor, end to end on tiny random
models: greedy tokens equal one rank's (ties accepted and counted) under chunked prefill
and preemption; a rank killed mid-generation makes the offline API raise naming the death
(not at an RPC timeout) and leaves no process behind."""

from __future__ import annotations

import os

import pytest
from parallel_greedy import assert_greedy_equals_one_rank, budget_llm, kill_rank_mid_generation

TP2, PP2 = {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("LlamaForCausalLM", TP2),
        ("LlamaForCausalLM", PP2),
        ("LlamaForCausalLM", {**TP2, **PP2}),  # 4 ranks share 2 cores
        # Two batches in flight under the fair policy's order.
        ("LlamaForCausalLM", {**PP2, "scheduling_policy": "fair"}),
        # One KV head replicated over both ranks, and a vocabulary padded to divide.
        ("Qwen2ForCausalLM:kv1-vocab509", TP2),
        ("LlamaForCausalLM:kv4-vocab509", TP2),
    ],
    ids=[
        "llama-tp2",
        "llama-pp2",
        "llama-tp2xpp2",
        "llama-pp2-fair",
        "qwen2-kv1-tp2",
        "llama-kv4-tp2",
    ],
)
def test_greedy_tokens_equal_one_rank(tiny_model_factory, model, layout, report_ties):
    directory = tiny_model_factory(model)
    llm = budget_llm(directory, **layout)
    try:
        assert_greedy_equals_one_rank(llm, directory, report_ties)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_a_rank_killed_mid_generation_raises_and_leaves_nothing(tiny_llama):
    llm = budget_llm(tiny_llama, tensor_parallel_size=2)
    engine = llm.llm_engine
    pids = engine.engine_core.model_executor.worker_pids
    try:
        died = r"worker rank 1 \(pid \d+\) died with exit code -9"
        kill_rank_mid_generation(engine, pids[1], died)
    finally:
        engine.engine_core.shutdown()
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids)
