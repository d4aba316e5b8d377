"""8-bit checkpoints (int8 W8A8 with dynamic per-token and static activations, FP8 per
tensor and in 128 x 128 blocks) over tensor-parallel ranks and pipeline stages through the
`mp` executor, under chunked prefill and preemption: int8 W8A8's greedy tokens and every
top-2 logprob equal one rank's exactly; FP8's greedy tokens equal one rank's (ties
counted) and their logprobs within fp32 rounding.

Each rank keeps whole output rows over the whole K (`model/layers/w8a8_parallel.py`), so
every activation scale is taken over a whole input row as on one rank, and each output
column is one rank's: bit for bit on the integer GEMM, within fp32 rounding through FP8's
bands of dequantized rows, whose torch.mm sums in an order that follows its shape and
threads (tests/model/test_w8a8_tensor_parallel.py). The shape is chosen
so that a K slice per rank would go wrong: down_proj's 384 inputs would be 192 a rank, half
of each token's row for its int8 or fp8 scale and one and a half blocks of 128; and rank 1's
192 rows of gate/up (and 64 of k and v) start inside a block of 128 rows. With LoRA over
two ranks the tokens are one rank's with the same adapters (ties counted): o and down, which
are `GatheredRowParallel`s as the packed ones are, apply all of A over the gathered input and
their rows of B (`RankCut.gathered`).
"""

from __future__ import annotations

import pytest
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
from quantized_llama import once_per_scheme
from w8a8_writer import format_named, write_w8a8_checkpoint

from pagedllm.model.layers.w8a8_linear import Int8W8A8Linear, TiledDequantLinear

# fp32 rounding through a dozen tokens of a two-layer model.
LOGPROB_TOLERANCE = 1e-4

SHAPE = dict(hidden_size=256, intermediate_size=384, head_dim=64)
LAYOUTS = [
    ("ct-int8-token", {"tensor_parallel_size": 2}),
    ("ct-int8-static", {"tensor_parallel_size": 2}),
    ("fp8-tensor", {"tensor_parallel_size": 2}),
    ("fp8-block", {"tensor_parallel_size": 2}),
    ("ct-int8-token", {"pipeline_parallel_size": 2}),
    ("fp8-block", {"pipeline_parallel_size": 2}),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (the 8-bit checkpoint, one rank's greedy outputs on it), made once each."""
    root = tmp_path_factory.mktemp("w8a8-parallel")
    source = make_tiny_model("LlamaForCausalLM", root / "fp32", **SHAPE)

    def build(name: str):
        write_w8a8_checkpoint(source, root / name, root / f"{name}-dequantized", format_named(name))
        llm = budget_llm(root / name)
        layers = (Int8W8A8Linear, TiledDequantLinear)
        assert any(isinstance(m, layers) for m in model_runner(llm).model.modules())
        return root / name, greedy_with_logprobs(llm, prompts(), MAX_TOKENS)

    return once_per_scheme(build)


@pytest.mark.parametrize(("name", "layout"), LAYOUTS, ids=lambda v: str(v))
def test_8_bit_checkpoint_across_ranks_equals_one_rank(checkpoints, report_ties, name, layout):
    path, expected = checkpoints(name)
    actual = greedy_across_ranks(path, **layout)
    fmt = format_named(name)
    if fmt.weight_type == "int":  # on the integer GEMM: one rank's numbers
        assert_bit_equal_to_reference(expected, actual, report_ties)
        return
    ties, largest = compare_to_reference_engine(expected, actual, TIE_TOLERANCE)
    report_ties(ties, len(actual))
    print(f"{name} {layout}: largest logprob difference {largest:.2e}")
    assert largest <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("name", ["ct-int8-token", "fp8-block"])
def test_lora_over_8_bit_ranks_equals_one_rank(checkpoints, tmp_path, report_ties, name):
    """Two adapters and the base model in one batch: two ranks give one rank's tokens, and
    the adapters change them."""
    path, _ = checkpoints(name)
    expected, actual = lora_on_one_rank_and_two(path, tmp_path)
    ties, largest = compare_to_reference_engine(expected, actual, TIE_TOLERANCE)
    report_ties(ties, len(actual))
    print(f"{name} with LoRA over 2 ranks: largest logprob difference {largest:.2e}")
