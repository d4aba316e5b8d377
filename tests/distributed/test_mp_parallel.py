"""Tensor and pipeline parallelism through the `mp` executor, end to end on tiny random
models: greedy tokens equal one rank's (ties accepted and counted) under chunked prefill
and preemption; a rank killed mid-generation makes the offline API raise within seconds
and leaves no process behind."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time

import pytest
from model_utils import compare_to_reference_engine, greedy_with_logprobs

from pagedllm import LLM, SamplingParams
from pagedllm.executor.multiproc_executor import WorkerError

TIE_TOLERANCE = 1e-4
PROMPT_LENGTHS = (3, 17, 40, 75)
MAX_TOKENS = 12
BLOCK_SIZE = 8
NUM_BLOCKS = 18  # the null block and 17 for four requests of up to 87 tokens: preemption


def _kv_cache_memory(directory, tp: int, pp: int) -> int:
    """Bytes one rank needs for NUM_BLOCKS blocks: its share of the KV heads (at least one,
    replicated) of its stage's layers."""
    config = json.loads((directory / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = max(1, config["num_key_value_heads"] // tp)
    layers = math.ceil(config["num_hidden_layers"] / pp)
    return NUM_BLOCKS * BLOCK_SIZE * 2 * layers * kv_heads * head_dim * 4  # K and V, fp32


def _llm(directory, **parallel) -> LLM:
    # Small budgets: prompts are prefilled in chunks, and the pool (the same number of
    # blocks in every layout) forces preemption.
    tp = parallel.get("tensor_parallel_size", 1)
    pp = parallel.get("pipeline_parallel_size", 1)
    return LLM(
        str(directory),
        max_model_len=128,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=32,
        kv_cache_memory=_kv_cache_memory(directory, tp, pp),
        **parallel,
    )


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


_REFERENCES: dict[str, list] = {}


def _reference(directory) -> list:
    """One rank's greedy tokens and logprobs for `_prompts()`, computed once per model."""
    if str(directory) not in _REFERENCES:
        llm = _llm(directory)
        outputs = greedy_with_logprobs(llm, _prompts(), MAX_TOKENS)
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0, "budget should preempt"
        _REFERENCES[str(directory)] = outputs
    return _REFERENCES[str(directory)]


TP2, PP2 = {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("LlamaForCausalLM", TP2),
        ("LlamaForCausalLM", PP2),
        ("LlamaForCausalLM", {**TP2, **PP2}),  # 4 ranks share 2 cores
        # One KV head replicated over both ranks, and a vocabulary padded to divide.
        ("Qwen2ForCausalLM:kv1-vocab509", TP2),
        ("LlamaForCausalLM:kv4-vocab509", TP2),
    ],
    ids=["llama-tp2", "llama-pp2", "llama-tp2xpp2", "qwen2-kv1-tp2", "llama-kv4-tp2"],
)
def test_greedy_tokens_equal_one_rank(tiny_model_factory, model, layout, report_ties):
    directory = tiny_model_factory(model)
    reference = _reference(directory)
    llm = _llm(directory, **layout)
    try:
        actual = greedy_with_logprobs(llm, _prompts(), MAX_TOKENS)
        core = llm.llm_engine.engine_core
        assert core.scheduler.num_preemptions > 0
        ties, _ = compare_to_reference_engine(reference, actual, TIE_TOLERANCE)
        report_ties(ties, len(actual))
        core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_a_rank_killed_mid_generation_raises_and_leaves_nothing(tiny_llama):
    llm = _llm(tiny_llama, tensor_parallel_size=2)
    engine = llm.llm_engine
    pids = engine.engine_core.model_executor.worker_pids
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    try:
        engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
        for _ in range(3):  # generation is under way
            engine.step()
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) died with exit code -9"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - killed_at < 10
    finally:
        engine.engine_core.shutdown()
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids)
