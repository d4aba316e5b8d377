"""A mixture whose experts are stored int8 W8A8 (dynamic per-token activations, Qwen3-MoE)
over two tensor-parallel ranks and over two pipeline stages (each swaps in its own layers'
experts) through the `mp` executor, under chunked prefill and preemption: one rank's greedy
tokens and top-2 logprobs, bit for bit.

Each rank keeps its rows of every expert's gate and up, and down gathers the intermediate
and computes the rank's hidden rows over all of it (`model/layers/w8a8_experts.py`), so
down's per-token scale is taken over the whole intermediate row as on one rank and every
output column is one rank's integer product; the block's all-reduce adds the other ranks'
zeros. The block's math over ranks is checked in one process in
tests/model/test_w8a8_moe.py.
"""

from __future__ import annotations

import pytest
from gptq_writer import MOE_LAYERS
from model_utils import assert_bit_equal_to_reference, greedy_with_logprobs, make_tiny_model
from parallel_greedy import MAX_TOKENS, budget_llm, greedy_across_ranks, prompts
from w8a8_writer import format_named, write_w8a8_checkpoint

SHAPE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, head_dim=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The 8-bit checkpoint and one rank's greedy outputs on it."""
    root = tmp_path_factory.mktemp("w8a8-moe-parallel")
    source = make_tiny_model("Qwen3MoeForCausalLM", root / "fp32", **SHAPE)
    fmt = format_named("ct-int8-token")
    write_w8a8_checkpoint(source, root / "w8a8", root / "dequantized", fmt, MOE_LAYERS)
    return root / "w8a8", greedy_with_logprobs(budget_llm(root / "w8a8"), prompts(), MAX_TOKENS)


@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_int8_experts_across_ranks_equal_one_rank(checkpoint, report_ties, layout):
    path, expected = checkpoint
    actual = greedy_across_ranks(path, **layout)
    assert_bit_equal_to_reference(expected, actual, report_ties)
