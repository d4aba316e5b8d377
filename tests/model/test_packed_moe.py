"""A mixture's experts stored packed (GPTQ, AWQ, compressed-tensors W4A16) served on their
packed integers (`model/layers/packed_experts.py`): the block equals the stacked fp32
experts on the dequantized weights (gate and up in one kernel call or, with act-order's
two input orders, one each; experts that get no token), tensor-parallel ranks' partial
outputs sum to the block's (each rank holding about half the tables) where their down
inputs are whole groups and are refused by name where not, an expert quantized in part and
a quantized router are refused, the block traces whole for the compiled decode step; and
whole tiny Mixtral and Qwen3-MoE checkpoints written by the test writers give Transformers'
greedy tokens on the dequantized model, every expert packed, their bytes about the
checkpoint's."""

from __future__ import annotations

import pytest
import torch
from awq_writer import AWQScheme, write_awq_checkpoint
from ct_writer import CTScheme, write_ct_checkpoint
from gptq_writer import MOE_LAYERS, Scheme, quantize_weight, write_gptq_checkpoint
from model_utils import make_tiny_model, model_runner
from moe_inputs import TOP_K, hidden_states, routing
from packed_checks import LOGPROB_TOLERANCE, check_engine

from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model.layers import fused_moe
from pagedllm.model.layers.fused_moe import GroupedExperts, MoESpec, grouped_experts
from pagedllm.model.layers.gguf_linear import GGUFConcatLinear
from pagedllm.model.layers.gptq_linear import GPTQMergedLinear
from pagedllm.model.layers.packed_experts import PackedGroupedExperts, packed_grouped_experts
from pagedllm.model.quantization.gptq import GPTQConfig
from pagedllm.model.quantization.gptq_format import GPTQTensors, unpack_gptq

EXPERTS, HIDDEN, INTERMEDIATE = 4, 128, 256
WHERE = "model.layers.0.mlp.experts"


class _StandInGroup(GroupCoordinator):
    """Rank `rank` of a `tp`-rank group in this process (no collective is called here)."""

    def __init__(self, rank: int, tp: int) -> None:
        super().__init__(list(range(tp)), rank, torch.device("cpu"))


def _parts(scheme: Scheme, seed: int = 0) -> dict:
    """(expert, shard) -> random weights of that shape quantized in `scheme`, unpacked."""
    generator = torch.Generator().manual_seed(seed)
    config = GPTQConfig.from_dict(scheme.quantization_config())
    shapes = {"gate": (INTERMEDIATE, HIDDEN), "up": (INTERMEDIATE, HIDDEN)}
    shapes["down"] = (HIDDEN, INTERMEDIATE)
    parts = {}
    for expert in range(EXPERTS):
        for shard, shape in shapes.items():
            weight = 0.2 * torch.randn(*shape, generator=generator)
            tensors = quantize_weight(weight, scheme, generator)
            parts[(expert, shard)] = unpack_gptq(GPTQTensors(**tensors), config)
    return parts


def _stacked(parts: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 stacked weights the parts dequantize to: gate_up [E, 2I, H], down [E, H, I]."""
    gate_up = [torch.cat([parts[(e, "gate")].dequantize(), parts[(e, "up")].dequantize()])
               for e in range(EXPERTS)]  # fmt: skip
    down = [parts[(e, "down")].dequantize() for e in range(EXPERTS)]
    return torch.stack(gate_up), torch.stack(down)


def _experts(parts: dict, monkeypatch=None, rank: int = 0, tp: int = 1) -> PackedGroupedExperts:
    if tp > 1:
        monkeypatch.setattr(fused_moe, "get_tp_group", lambda: _StandInGroup(rank, tp))
    spec = MoESpec(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, True, False)
    module = GroupedExperts(spec, torch.float32)
    return packed_grouped_experts(module, set(parts), parts.__getitem__, WHERE)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize(
    ("scheme", "fused"),
    [
        (Scheme(128, desc_act=False, sym=True), True),  # gate/up in one kernel call
        (Scheme(32, desc_act=True, sym=False), False),  # gate and up: an input order each
        (Scheme(-1, desc_act=False, sym=False), True),  # per channel
    ],
    ids=str,
)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_packed_experts_equal_the_dequantized_stacked_experts(scheme, fused, num_tokens):
    parts = _parts(scheme)
    layer = _experts(parts)
    kind = GPTQMergedLinear if fused else GGUFConcatLinear
    assert all(isinstance(expert, kind) for expert in layer.gate_up)
    gate_up, down = _stacked(parts)
    x = hidden_states(num_tokens, HIDDEN)
    ids, weights = routing(num_tokens, [0, 2, 3])  # expert 1 gets no token
    want = grouped_experts(x.double(), ids, weights.double(), gate_up.double(), down.double())
    got = layer(x, ids, weights)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # Within the kernel's two-digit activation quantization, as for a dense packed layer.
    assert _relative_error(got, want) < 1e-3
    assert layer.missing_shards() == []


@pytest.mark.parametrize(
    "scheme",
    [Scheme(128, desc_act=False, sym=True), Scheme(32, False, False), Scheme(-1, False, False)],
    ids=str,
)
def test_tensor_parallel_ranks_sum_to_the_block(monkeypatch, scheme):
    """Two ranks: gate/up rows and down inputs 128 of 256 each; the partial outputs summed
    (the block's all-reduce) are the block's, and each rank holds about half the tables."""
    parts = _parts(scheme)
    whole = _experts(parts)
    x, (ids, weights) = hidden_states(9, HIDDEN), routing(9, [0, 1, 2, 3])
    gate_up, down = _stacked(parts)
    want = grouped_experts(x.double(), ids, weights.double(), gate_up.double(), down.double())
    total = torch.zeros_like(x)
    for rank in range(2):
        layer = _experts(parts, monkeypatch, rank, tp=2)
        assert layer.gate_up[0].out_features == INTERMEDIATE  # its 128 gate and 128 up rows
        assert layer.down[0].in_features == INTERMEDIATE // 2
        assert layer.weight_bytes() <= 0.55 * whole.weight_bytes()
        total += layer(x, ids, weights)
    assert _relative_error(total, want) < 1e-3


@pytest.mark.parametrize(
    ("scheme", "tp", "named"),
    [
        (Scheme(32, desc_act=True, sym=False), 2, "act-order"),
        (Scheme(128, desc_act=False, sym=True), 4, "64 inputs cuts the groups of 128"),
    ],
    ids=["act-order", "g128-over-4-ranks"],
)
def test_down_inputs_a_rank_cannot_keep_whole_are_refused_by_name(monkeypatch, scheme, tp, named):
    parts = _parts(scheme)
    with pytest.raises(ValueError, match=f"tensor-parallel ranks .*{named}"):
        _experts(parts, monkeypatch, rank=1, tp=tp)


def test_experts_quantized_in_part_are_refused_by_name():
    parts = _parts(Scheme(128, desc_act=False, sym=True))
    del parts[(2, "down")]
    with pytest.raises(ValueError, match=r"not \(expert, shard\) \[\(2, 'down'\)\]"):
        _experts(parts)


def test_packed_experts_trace_whole_for_the_compiled_decode_step():
    layer = _experts(_parts(Scheme(128, desc_act=False, sym=True)))
    traced = torch.compile(layer, backend="eager", fullgraph=True, dynamic=True)
    for num_tokens in (1, 3):
        x = hidden_states(num_tokens, HIDDEN)
        ids, weights = routing(num_tokens, [0, 1, 2, 3])
        with torch.no_grad():
            assert torch.equal(traced(x, ids, weights), layer(x, ids, weights))


# ---- whole models ---------------------------------------------------------------------------
# Inputs and outputs of whole groups of 128: each expert 256 x 256.
MODEL_SHAPES = {
    "MixtralForCausalLM": dict(hidden_size=256, intermediate_size=256, head_dim=64),
    # Layers 0 and 2 sparse, layer 1 a dense MLP of intermediate_size.
    "Qwen3MoeForCausalLM": dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=256, head_dim=64
    ),
}
GPTQ_G128 = Scheme(128, desc_act=False, sym=True)
GPTQ_G32_ACT_ORDER = Scheme(32, desc_act=True, sym=False)
MIXTRAL_AWQ = AWQScheme(128, not_converted=("gate",))


def _gptq(scheme: Scheme):
    return lambda src, q, d: write_gptq_checkpoint(src, q, d, scheme, 0, MOE_LAYERS)


# name -> (architecture, method, writer, packed layers: attention + dense MLPs + experts)
CHECKPOINTS = {
    # qkv and o in 2 layers; each expert's gate/up and down
    "mixtral-gptq-g128": ("MixtralForCausalLM", "gptq", _gptq(GPTQ_G128), 2 * 2 + 2 * 4 * 2),
    # AutoAWQ's Mixtral config names the router in modules_to_not_convert
    "mixtral-awq-g128": (
        "MixtralForCausalLM",
        "awq",
        lambda src, q, d: write_awq_checkpoint(src, q, d, MIXTRAL_AWQ, 0, MOE_LAYERS),
        2 * 2 + 2 * 4 * 2,
    ),
    # q, k, v apart and o in 3 layers; gate, up apart and down in the dense one; each
    # expert's gate and up apart (an input order each) and its down in the 2 sparse ones
    "qwen3-moe-gptq-g32-act-order": (
        "Qwen3MoeForCausalLM",
        "gptq",
        _gptq(GPTQ_G32_ACT_ORDER),
        3 * 4 + 3 + 2 * 4 * 3,
    ),
    "qwen3-moe-w4a16-g128": (
        "Qwen3MoeForCausalLM",
        "compressed-tensors",
        lambda src, q, d: write_ct_checkpoint(src, q, d, CTScheme(4, 128), 0, MOE_LAYERS),
        3 * 2 + 2 + 2 * 4 * 2,
    ),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """architecture -> the tiny fp32 model, written once."""
    return {
        arch: make_tiny_model(arch, tmp_path_factory.mktemp(arch), **shape)
        for arch, shape in MODEL_SHAPES.items()
    }


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_moe_checkpoint_serves_transformers_tokens_on_packed_experts(
    sources, tmp_path, report_ties, name
):
    architecture, method, write, packed_layers = CHECKPOINTS[name]
    quantized, dequantized = tmp_path / "packed", tmp_path / "dequantized"
    checkpoint_bytes = write(sources[architecture], quantized, dequantized)
    check = check_engine(quantized, dequantized, method)
    report_ties(check.ties, 3)
    assert check.largest_logprob_error < LOGPROB_TOLERANCE
    # Every expert on packed layers (counted apiece), holding about the checkpoint's bytes.
    assert check.packed_layers == packed_layers
    held = check.held_bytes
    print(f"{name}: checkpoint {checkpoint_bytes} B, held {held} ({held / checkpoint_bytes:.3f}x)")
    assert 0.9 * checkpoint_bytes <= held <= 1.1 * checkpoint_bytes
    # No fp32 copy of an expert: the largest parameter left is a router's [experts, hidden].
    assert check.largest_layer_parameter <= EXPERTS * MODEL_SHAPES[architecture]["hidden_size"]


@pytest.mark.parametrize(
    ("architecture", "quantization_config", "sparse_layers"),
    [
        ("Qwen3MoeForCausalLM", GPTQ_G128.quantization_config(), 2),  # layer 1 is dense
        # AutoAWQ names the router "gate" in modules_to_not_convert: Mixtral's experts
        # (block_sparse_moe.experts.E.w1|w3|w2 in its checkpoints) are quantized all the same.
        ("MixtralForCausalLM", MIXTRAL_AWQ.quantization_config(), 2),
    ],
    ids=["qwen3-moe-gptq", "mixtral-awq"],
)
def test_dummy_weights_put_the_experts_on_random_packed_layers(
    sources, tmp_path, architecture, quantization_config, sparse_layers
):
    """A config.json alone with a packed quantization_config and load_format="dummy": every
    sparse layer's experts packed, no fp32 expert left, and the model generates."""
    import json
    import math

    from pagedllm import LLM, SamplingParams
    from pagedllm.model.loader import write_config_dir

    config = json.loads((sources[architecture] / "config.json").read_text())
    config["quantization_config"] = quantization_config
    shapes = write_config_dir(str(tmp_path / "shape-only"), config)
    dummy = {"load_format": "dummy", "skip_tokenizer_init": True}
    llm = LLM(str(shapes), max_model_len=128, kv_cache_memory="8MiB", **dummy)
    model = model_runner(llm).model
    experts = [m for m in model.modules() if isinstance(m, PackedGroupedExperts)]
    assert len(experts) == sparse_layers
    assert all(isinstance(layer, GPTQMergedLinear) for e in experts for layer in e.gate_up)
    hidden = MODEL_SHAPES[architecture]["hidden_size"]
    assert max(p.numel() for n, p in model.named_parameters() if "layers" in n) <= EXPERTS * hidden
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    (output,) = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8
    assert all(
        math.isfinite(lp.logprob) for step in output.outputs[0].logprobs for lp in step.values()
    )


def test_a_quantized_router_is_refused_by_name():
    """The tools leave the router unquantized; a checkpoint that packs it is refused, not
    read as an expert."""
    from transformers import AutoConfig

    from pagedllm.model.layers.gptq_swap import LAYOUT
    from pagedllm.model.layers.packed_swap import swap_packed_layers
    from pagedllm.model.registry import resolve_model_class
    from pagedllm.ops.attention_registry import get_attention_backend

    config = AutoConfig.for_model(
        "qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
    )  # fmt: skip
    model_class = resolve_model_class(config.architectures)
    model = model_class(config, get_attention_backend("torch"), torch.float32, 256)
    layers = {"model.layers.0.mlp.gate": {"qweight": torch.zeros(8, EXPERTS)}}
    named = r"'model\.layers\.0\.mlp\.gate'.*MoE routers .* not served"
    with pytest.raises(ValueError, match=named):
        swap_packed_layers(model, layers, lambda prefix, tensors: None, "gptq", LAYOUT)
