"""A mixture whose experts are stored packed (GPTQ, Qwen3-MoE) over tensor-parallel ranks
and pipeline stages through the `mp` executor: one rank's greedy tokens (ties counted)
under chunked prefill and preemption.

Each rank keeps its rows of every expert's gate and up and the same slice of its down's
inputs, whole groups (`model/layers/packed_experts.py`), and the block's all-reduce sums
the ranks' partial outputs as it does for fp32 experts: close to one rank's numbers, not
its bits (the dense packed layers' are). 256 expert inputs are 128 a rank: one group of
128 each. Down groups a rank's slice would cut are refused by name
(tests/model/test_packed_moe.py).
"""

from __future__ import annotations

import pytest
from gptq_writer import MOE_LAYERS, Scheme, write_gptq_checkpoint
from model_utils import make_tiny_model
from parallel_greedy import assert_greedy_equals_one_rank, budget_llm

SHAPE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, head_dim=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed-moe-parallel")
    source = make_tiny_model("Qwen3MoeForCausalLM", root / "fp32", **SHAPE)
    scheme = Scheme(128, desc_act=False, sym=False)
    write_gptq_checkpoint(source, root / "gptq", root / "dequantized", scheme, 0, MOE_LAYERS)
    return root / "gptq"


@pytest.mark.parametrize(
    "layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"]
)
def test_packed_experts_across_ranks_give_one_ranks_tokens(checkpoint, report_ties, layout):
    llm = budget_llm(checkpoint, **layout)
    try:
        assert_greedy_equals_one_rank(llm, checkpoint, report_ties)
    finally:
        llm.llm_engine.engine_core.shutdown()
