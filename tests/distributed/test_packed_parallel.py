"""Checkpoints stored packed (GPTQ, AWQ; compressed-tensors goes through the same layers)
over tensor-parallel ranks and pipeline stages through the `mp` executor: greedy tokens and
every top-2 logprob equal one rank's exactly, under chunked prefill and preemption.

Each rank keeps whole output rows with all their groups (`model/layers/packed_parallel.py`),
so the packed layers compute one rank's numbers; 4 q heads on 2 KV heads keep 2 q heads a
KV head on every rank, so the fp32 attention kernel does too. The shape is chosen so that a
K slice per rank would cut groups: down_proj's 384 inputs are 192 a rank, one and a half
groups of 128; the GPTQ checkpoint's act-order scatters every group over K. With LoRA over
two ranks the tokens are one rank's with the same adapters (ties counted): o and down
apply all of A over the gathered input and their rows of B (`RankCut.gathered`).
"""

from __future__ import annotations

import pytest
from awq_writer import AWQScheme, write_awq_checkpoint
from gptq_writer import Scheme, write_gptq_checkpoint
from model_utils import (
    assert_bit_equal_to_reference,
    compare_to_reference_engine,
    greedy_with_logprobs,
    make_tiny_model,
    model_runner,
)
from parallel_greedy import (
    MAX_TOKENS,
    TIE_TOLERANCE,
    budget_llm,
    greedy_across_ranks,
    lora_on_one_rank_and_two,
    prompts,
)

from pagedllm.model.layers.gptq_linear import GPTQLinear

SHAPE = dict(hidden_size=256, intermediate_size=384, head_dim=64)
CHECKPOINTS = {
    "gptq-g128-act-order": lambda src, dst, deq: write_gptq_checkpoint(
        src, dst, deq, Scheme(128, desc_act=True, sym=False)
    ),
    "awq-g128": lambda src, dst, deq: write_awq_checkpoint(src, dst, deq, AWQScheme(128)),
}
LAYOUTS = [
    ("gptq-g128-act-order", {"tensor_parallel_size": 2}),
    ("awq-g128", {"tensor_parallel_size": 2}),
    ("gptq-g128-act-order", {"pipeline_parallel_size": 2}),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """name -> (the packed checkpoint, one rank's greedy outputs on it)."""
    root = tmp_path_factory.mktemp("packed-parallel")
    source = make_tiny_model("LlamaForCausalLM", root / "fp32", **SHAPE)
    built = {}
    for name, write in CHECKPOINTS.items():
        write(source, root / name, root / f"{name}-dequantized")
        llm = budget_llm(root / name)
        assert any(isinstance(m, GPTQLinear) for m in model_runner(llm).model.modules())
        built[name] = (root / name, greedy_with_logprobs(llm, prompts(), MAX_TOKENS))
    return built


def test_lora_over_packed_ranks_equals_one_rank(checkpoints, tmp_path, report_ties):
    """GPTQ act-order (q/k/v and gate/up one layer per part) with two adapters and the base
    model in one batch: two ranks give one rank's tokens, and the adapters change them."""
    path, _ = checkpoints["gptq-g128-act-order"]
    expected, actual = lora_on_one_rank_and_two(path, tmp_path)
    ties, _ = compare_to_reference_engine(expected, actual, TIE_TOLERANCE)
    report_ties(ties, len(actual))


@pytest.mark.parametrize(("name", "layout"), LAYOUTS, ids=lambda v: str(v))
def test_packed_checkpoint_across_ranks_equals_one_rank(checkpoints, report_ties, name, layout):
    path, expected = checkpoints[name]
    actual = greedy_across_ranks(path, **layout)
    assert_bit_equal_to_reference(expected, actual, report_ties)
