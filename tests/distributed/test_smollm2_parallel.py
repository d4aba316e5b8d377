"""The default model (SmolLM2-135M-Instruct, from its GGUF: 9 heads, 3 KV heads, 30 layers,
intermediate 1536) through the `mp` executor: greedy tokens equal one rank's (ties accepted
and counted) at TP=3 and PP=2, under chunked prefill and preemption; TP=2, which its heads
do not divide, is refused at start-up, before any process starts, naming the sizes that
work."""

from __future__ import annotations

import multiprocessing

import pytest
from model_utils import compare_to_reference_engine, greedy_with_logprobs

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.core.engine_config import kv_bytes_per_block, load_engine_config
from pagedllm.executor.multiproc_executor import MultiprocExecutor
from pagedllm.parallel_config import ParallelConfig

TIE_TOLERANCE = 1e-4
# Short generations: three ranks and the reference share two cores.
MAX_TOKENS = 8
BLOCK_SIZE = 16
MAX_MODEL_LEN = 96
# The null block and 6 for prompts of 1, 5, 30 and 59 tokens needing 10 at their longest:
# preemption. Every layout gets the same number of blocks, each rank's of its own heads and
# layers.
NUM_BLOCKS = 7
TEXTS = [
    "Hi",
    "The capital of France is",
    "Paged attention stores keys and values in fixed-size blocks of memory, so that "
    "a sequence never needs one contiguous region and blocks can be shared.",
    "Tensor parallelism splits every layer's heads and columns over several ranks, which "
    "then add their partial results together; pipeline parallelism instead gives each "
    "rank a contiguous range of layers and passes the hidden states from one stage to "
    "the next, so that while one stage works on a batch the other works on another.",
]


def _llm(model_config, tp: int = 1, pp: int = 1) -> LLM:
    """The default model with small budgets: prompts prefill in chunks and the pool (in
    every layout NUM_BLOCKS blocks of each rank's own heads and layers) forces preemption."""
    layout = ParallelConfig(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp"
    )
    block_bytes = kv_bytes_per_block(model_config, BLOCK_SIZE, model_config.dtype, layout)
    return LLM(
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=32,
        kv_cache_memory=NUM_BLOCKS * block_bytes,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )


@pytest.fixture(scope="module")
def reference():
    """(model config, prompts, one rank's greedy completions): computed once."""
    _, tokenizer, config = load_engine_config(EngineArgs(), log=False)  # loads no weights
    model_config = config.model_config
    prompts = [tokenizer.encode(text) for text in TEXTS]
    llm = _llm(model_config)
    try:
        outputs = greedy_with_logprobs(llm, prompts, MAX_TOKENS)
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0, "budget should preempt"
    finally:
        llm.llm_engine.engine_core.shutdown()
    return model_config, prompts, outputs


@pytest.mark.slow
def test_prompts_span_chunks_and_blocks(reference):
    _, prompts, _ = reference
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] == 1 and lengths[-1] > 32, lengths  # one token; two chunks


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(3, 1), (1, 2)], ids=["tp3", "pp2"])
def test_greedy_tokens_equal_one_rank(reference, tp, pp, report_ties):
    model_config, prompts, expected = reference
    llm = _llm(model_config, tp=tp, pp=pp)
    core = llm.llm_engine.engine_core
    try:
        assert core.config.distributed_executor_backend == "mp"
        actual = greedy_with_logprobs(llm, prompts, MAX_TOKENS)
        assert core.scheduler.num_preemptions > 0
        ties, _ = compare_to_reference_engine(expected, actual, TIE_TOLERANCE)
        report_ties(ties, len(actual))
        core.check_integrity()
    finally:
        core.shutdown()


def test_tp2_is_refused_before_any_process_starts(monkeypatch):
    def no_workers(self):
        raise AssertionError("a worker process was about to start")

    monkeypatch.setattr(MultiprocExecutor, "_init_executor", no_workers)
    children = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*Sizes that work: 1, 3$"):
        LLM(tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) == children
