"""LoRA on a checkpoint stored packed (GPTQ here; AWQ and compressed-tensors load into the
same layers): the adapters' deltas run in fp32 beside the packed kernel layers, on a fused
q/k/v and gate/up of one layer (one input order) and on one layer per part (act-order, an
order each). Greedy tokens equal Transformers + PEFT with each adapter merged into the
dequantized model (ties counted; the kernels' 16-bit activations are the only difference,
~1e-5 in logprobs), and the adapters change the answers. Over tensor-parallel ranks (in one
process, ranks built in turn), a row-parallel packed layer's rows plus its delta over the
gathered input are one rank's LoRA output columns; the engine at TP=2 is
tests/distributed/test_packed_parallel.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gptq_writer import Scheme, write_gptq_checkpoint
from lora_greedy import check_adapters_on_quantized_base
from lora_utils import merged_model
from model_utils import make_tiny_model

from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.lora.model.layers import LoRALinear
from pagedllm.model.layers.gguf_linear import GGUFConcatLinear
from pagedllm.model.layers.gptq_linear import GPTQLinear

# Inputs of whole groups of 128 (o_proj: 4 heads x 64).
SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), **SHAPE)


@pytest.mark.parametrize(
    "scheme", [Scheme(128, desc_act=False, sym=True), Scheme(64, desc_act=True, sym=False)], ids=str
)
def test_packed_base_with_adapters_equals_peft_on_the_dequantized_model(
    tiny_llama, tmp_path, report_ties, scheme
):
    quantized, dequantized = tmp_path / "gptq", tmp_path / "dequantized"
    write_gptq_checkpoint(tiny_llama, quantized, dequantized, scheme)
    check_adapters_on_quantized_base(
        quantized,
        dequantized,
        tmp_path,
        (GPTQLinear, GGUFConcatLinear),
        lambda adapter: merged_model(dequantized, adapter),
        report_ties,
    )


class _StandInGroup(GroupCoordinator):
    """Rank `rank` of a `tp`-rank group in this process (no collective is called here)."""

    def __init__(self, rank: int, tp: int) -> None:
        super().__init__(list(range(tp)), rank, torch.device("cpu"))


@pytest.mark.parametrize("slots", [[0] * 5, [0, 1, 0, 1, 1, 0]], ids=["run", "two-adapters"])
@pytest.mark.parametrize(("out_features", "tp"), [(96, 2), (104, 3)], ids=["even", "padded"])
def test_a_gathered_row_parallel_ranks_deltas_are_one_ranks_columns(
    monkeypatch, slots, out_features, tp
):
    """o / down on packed weights over tp ranks: each rank's own rows plus its delta, over
    the gathered input with all of A and its rows of B (`RankCut.gathered`), are one rank's
    LoRA output columns; the last rank's padding rows stay zero."""
    from gptq_writer import quantize_weight
    from rank_columns import outlier_input, rank_columns

    from pagedllm.lora.model.layers import LoRAState, LoRAStep, apply_lora, rank_cut
    from pagedllm.model.layers import parallel_linear
    from pagedllm.model.layers.gguf_parallel import output_row_slice
    from pagedllm.model.layers.packed_parallel import parallel_packed_layer, rank_weights
    from pagedllm.model.layers.parallel_linear import RowParallelLinear
    from pagedllm.model.quantization.gptq import GPTQConfig
    from pagedllm.model.quantization.gptq_format import GPTQTensors, unpack_gptq

    k, rank_of_adapter, generator = 384, 8, torch.Generator().manual_seed(2)
    scheme = Scheme(64, desc_act=True, sym=False)
    tensors = quantize_weight(torch.randn(out_features, k, generator=generator), scheme, generator)
    weights = unpack_gptq(
        GPTQTensors(**tensors), GPTQConfig.from_dict(scheme.quantization_config())
    )
    adapters = [
        (0.1 * torch.randn(rank_of_adapter, k, generator=generator),
         0.1 * torch.randn(out_features, rank_of_adapter, generator=generator))
        for _ in range(2)
    ]  # fmt: skip
    x = outlier_input(len(slots), k)
    step = LoRAStep.build(np.array(slots), 2, torch.device("cpu"))

    def wrapped(base, cut) -> LoRALinear:
        state = LoRAState()
        state.step = step
        shape = {None: slice(0, base.out_features)}
        layer = LoRALinear(base, k, shape, 2, 8, state, torch.float32, torch.device("cpu"), cut)
        for slot, (lora_a, lora_b) in enumerate(adapters):
            layer.set_slice(slot, None, lora_a, lora_b)
        return layer

    one_rank = wrapped(GPTQLinear(weights), None)(x)
    assert not torch.equal(one_rank, GPTQLinear(weights)(x))  # the deltas are applied
    for rank in range(tp):
        group = _StandInGroup(rank, tp)
        monkeypatch.setattr(parallel_linear, "get_tp_group", lambda group=group: group)
        module = RowParallelLinear(k, out_features, False, torch.float32)
        base = parallel_packed_layer(module, rank_weights(module, None, weights))
        cut = rank_cut("o_proj", base, [None], k, tp)
        keep = output_row_slice(out_features, rank, tp)
        assert cut.gathered and cut.b_rows == {None: keep.start}
        layer = wrapped(base, cut)
        mine = apply_lora(layer, base.own_rows(x), x, step)  # what forward does between gathers
        torch.testing.assert_close(mine, rank_columns(one_rank, keep), rtol=1e-5, atol=1e-6)
        assert not mine[:, keep.rows :].any()
