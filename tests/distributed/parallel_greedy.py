"""The greedy comparison the parallel executors share (`mp` and `ray`): small budgets that
force chunked prefill and preemption, fixed prompts, and one rank's reference outputs,
computed once per model and compared token by token (ties accepted and counted)."""

from __future__ import annotations

import json
import math
import os
import random
import signal
from pathlib import Path

import pytest
from lora_utils import make_peft_adapter
from model_utils import compare_to_reference_engine, greedy_with_logprobs

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.executor.multiproc_executor import WorkerError

TIE_TOLERANCE = 1e-4
PROMPT_LENGTHS = (3, 17, 40, 75)
MAX_TOKENS = 12
BLOCK_SIZE = 8
NUM_BLOCKS = 18  # the null block and 17 for four requests of up to 87 tokens: preemption


def kv_cache_memory(directory, tp: int, pp: int) -> int:
    """Bytes one rank needs for NUM_BLOCKS blocks: its share of the KV heads (at least one,
    replicated) of its stage's layers."""
    config = json.loads((directory / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = max(1, config["num_key_value_heads"] // tp)
    layers = math.ceil(config["num_hidden_layers"] / pp)
    return NUM_BLOCKS * BLOCK_SIZE * 2 * layers * kv_heads * head_dim * 4  # K and V, fp32


def budget_llm(directory, draft_directory=None, **parallel) -> LLM:
    """An `LLM` whose small budgets make prompts prefill in chunks and whose pool (the same
    number of blocks in every layout) forces preemption. `draft_directory`: a speculative
    draft model's, whose whole KV every rank's budget holds beside its share."""
    tp = parallel.get("tensor_parallel_size", 1)
    pp = parallel.get("pipeline_parallel_size", 1)
    memory = kv_cache_memory(directory, tp, pp)
    if draft_directory is not None:
        memory += kv_cache_memory(draft_directory, 1, 1)
    return LLM(
        str(directory),
        max_model_len=128,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=32,
        kv_cache_memory=memory,
        **parallel,
    )


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


# Repeated patterns (the speculative proposers find them) beside the shared prompts.
SPEC_PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 9, *prompts()]

_REFERENCES: dict[str, list] = {}


def reference(directory) -> list:
    """One rank's greedy tokens and logprobs for `prompts()`, computed once per model."""
    if str(directory) not in _REFERENCES:
        llm = budget_llm(directory)
        outputs = greedy_with_logprobs(llm, prompts(), MAX_TOKENS)
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0, "budget should preempt"
        _REFERENCES[str(directory)] = outputs
    return _REFERENCES[str(directory)]


def assert_greedy_equals_one_rank(llm: LLM, directory, report_ties) -> None:
    """`llm` (any layout) gives one rank's greedy tokens under preemption; ties counted."""
    expected = reference(directory)
    actual = greedy_with_logprobs(llm, prompts(), MAX_TOKENS)
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0
    ties, _ = compare_to_reference_engine(expected, actual, TIE_TOLERANCE)
    report_ties(ties, len(actual))
    core.check_integrity()


def greedy_across_ranks(directory, **layout) -> list:
    """`directory`'s greedy outputs for `prompts()` over `layout`, whose budget must preempt;
    the engine's books are checked and its ranks stopped however the run ends."""
    llm = budget_llm(directory, **layout)
    try:
        actual = greedy_with_logprobs(llm, prompts(), MAX_TOKENS)
        core = llm.llm_engine.engine_core
        assert core.scheduler.num_preemptions > 0
        core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()
    return actual


def lora_on_one_rank_and_two(directory: Path, adapter_root: Path) -> tuple[list, list]:
    """Two adapters (made on `directory`'s `-dequantized` twin, under `adapter_root`) and the
    base model in one batch: (one rank's outputs, two ranks'). The adapters must change the
    tokens they are given, or the comparison would not show them applied over the ranks."""
    dequantized = directory.parent / f"{directory.name}-dequantized"
    adapters = [
        LoRARequest(
            f"a{i}",
            i + 1,
            str(make_peft_adapter(dequantized, adapter_root / f"a{i}", i + 1, std=0.3)),
        )
        for i in range(2)
    ]
    loras = [adapters[0], adapters[1], None, adapters[0]]
    batch = [{"prompt_token_ids": prompt} for prompt in prompts()]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)

    def generate(llm, loras=loras) -> list:
        outputs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
        return [output.outputs[0] for output in outputs]

    one_rank = budget_llm(directory, enable_lora=True, max_loras=2)
    expected = generate(one_rank)
    base = generate(one_rank, loras=None)
    changed = [e.token_ids != b.token_ids for e, b in zip(expected, base, strict=True)]
    assert changed == [lora is not None for lora in loras]
    llm = budget_llm(directory, enable_lora=True, max_loras=2, tensor_parallel_size=2)
    try:
        actual = generate(llm)
        llm.llm_engine.engine_core.check_integrity()
    finally:
        llm.llm_engine.engine_core.shutdown()
    return expected, actual


def kill_rank_mid_generation(engine, pid: int, error_pattern: str) -> None:
    """SIGKILL a rank's process three steps into a long generation; step on until the engine
    raises WorkerError matching `error_pattern`. A pattern naming the death shows it was seen
    at once: a death the executor missed would end only at the RPC timeout (600 s by
    default), with a "did not answer" error instead."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
    for _ in range(3):  # generation is under way
        engine.step()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match=error_pattern):
        while engine.has_unfinished_requests():
            engine.step()
