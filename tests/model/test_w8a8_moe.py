"""A mixture's experts stored 8-bit (compressed-tensors int8 W8A8 per channel with dynamic
per-token activations, FP8 dynamic per channel, `fp8` 128 x 128 blocks) served on their
8-bit weights (`model/layers/w8a8_experts.py`): the block computes the reference math (the
dequantized experts on fake-quantized activations, experts that get no token included);
two tensor-parallel ranks, run as threads that meet in their all-gathers, join to the
block's output (int8 bit for bit) each holding about half the bytes; an expert quantized in
part and a quantized router are refused by name; whole tiny Mixtral and Qwen3-MoE
checkpoints give Transformers' greedy tokens on the dequantized model with the same
activation quantization (ties counted), every expert 8-bit, their bytes about the
checkpoint's; and load_format="dummy" puts the experts on random 8-bit layers."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from gptq_writer import MOE_LAYERS
from model_utils import compare_greedy, hf_greedy, make_tiny_model, model_runner
from moe_inputs import TOP_K, hidden_states, routing
from w8a8_writer import (
    add_activation_quantization,
    add_expert_activation_quantization,
    fake_quantize_activation,
    format_named,
    quantize_weight,
    reference_dequantize,
    write_w8a8_checkpoint,
)

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model.layers import fused_moe
from pagedllm.model.layers.fused_moe import GroupedExperts, MoESpec
from pagedllm.model.layers.w8a8_experts import W8A8GroupedExperts, w8a8_grouped_experts
from pagedllm.model.layers.w8a8_linear import Int8W8A8Linear, TiledDequantLinear
from pagedllm.model.layers.w8a8_swap import checkpoint_scheme, layer_weights, log_w8a8_layers

EXPERTS, HIDDEN, INTERMEDIATE = 4, 128, 256
WHERE = "model.layers.0.mlp.experts"
INT8_TOKEN, FP8_DYNAMIC, FP8_BLOCK = map(
    format_named, ["ct-int8-token", "ct-fp8-dynamic", "fp8-block"]
)
TIE_TOLERANCE = 1e-3
MAX_NEW_TOKENS = 12


def _tensors(fmt, seed: int = 0) -> dict:
    """(expert, shard) -> random weights of that shape as the format's checkpoint tensors."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"gate": (INTERMEDIATE, HIDDEN), "up": (INTERMEDIATE, HIDDEN)}
    shapes["down"] = (HIDDEN, INTERMEDIATE)
    return {
        (expert, shard): quantize_weight(0.1 * torch.randn(*shape, generator=generator), fmt)
        for expert in range(EXPERTS)
        for shard, shape in shapes.items()
    }


def _experts(fmt, tensors: dict, group: GroupCoordinator | None = None) -> W8A8GroupedExperts:
    """The block on `tensors`' 8-bit parts, built as the rank of `group` (one rank: None)."""
    scheme = checkpoint_scheme(fmt.method, fmt.quantization_config())
    spec = MoESpec(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, True, False)
    with pytest.MonkeyPatch.context() as patch:
        if group is not None:
            patch.setattr(fused_moe, "get_tp_group", lambda: group)
        module = GroupedExperts(spec, torch.float32)
    weights = {part: layer_weights(str(part), t, scheme) for part, t in tensors.items()}
    return w8a8_grouped_experts(module, set(weights), weights.__getitem__, WHERE)


def _reference(fmt, tensors: dict, x, ids, weights) -> torch.Tensor:
    """Token by token: each chosen expert on the dequantized weights, its gate/up and down
    inputs fake-quantized (`w8a8_writer`), in fp32 as the layers compute; summed in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token in range(x.shape[0]):
        for choice in range(ids.shape[1]):
            expert = int(ids[token, choice])
            gate, up = (reference_dequantize(tensors[(expert, s)], fmt) for s in ("gate", "up"))
            row = fake_quantize_activation(x[token : token + 1], fmt)
            hidden = F.silu(row @ gate.T) * (row @ up.T)
            down = reference_dequantize(tensors[(expert, "down")], fmt)
            y = fake_quantize_activation(hidden, fmt) @ down.T
            out[token] += weights[token, choice].double() * y[0].double()
    return out


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("fmt", [INT8_TOKEN, FP8_DYNAMIC, FP8_BLOCK], ids=str)
def test_8_bit_experts_compute_the_reference_math(fmt):
    tensors = _tensors(fmt)
    layer = _experts(fmt, tensors)
    kind = Int8W8A8Linear if fmt is INT8_TOKEN else TiledDequantLinear
    assert all(isinstance(e, kind) for e in (*layer.gate_up, *layer.down))
    assert all(e.out_features == 2 * INTERMEDIATE for e in layer.gate_up)  # one call each
    x = hidden_states(7, HIDDEN)
    ids, weights = routing(7, [0, 2, 3])  # expert 1 gets no token
    got = layer(x, ids, weights)
    assert got.dtype == torch.float32 and got.shape == x.shape
    # fp32 rounding (the integer GEMM's scales, torch.mm's sums) against float64 sums.
    assert _relative_error(got, _reference(fmt, tensors, x, ids, weights)) < 1e-5
    assert layer.missing_shards() == []


class _Meeting:
    """Where ranks run as threads meet: a barrier, a slot per rank, and the turn (one rank
    computes at a time, as the 8-bit layers' shared band buffer needs; a rank gives up its
    turn only while it waits for the others)."""

    def __init__(self, tp: int) -> None:
        self.barrier = threading.Barrier(tp, timeout=60)
        self.slots: list = [None] * tp
        self.turn = threading.Lock()

    def run(self, forward):
        with self.turn:
            return forward()


class _ThreadedGroup(GroupCoordinator):
    """Rank `rank` of `tp` ranks run as threads of this process: `all_gather` (the only
    collective the experts call) meets the other ranks."""

    def __init__(self, rank: int, tp: int, meeting: _Meeting) -> None:
        super().__init__(list(range(tp)), rank, torch.device("cpu"))
        self.meeting = meeting

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        meeting = self.meeting
        meeting.slots[self.rank_in_group] = tensor.clone()
        meeting.turn.release()
        meeting.barrier.wait()
        gathered = torch.cat(meeting.slots, dim=dim)
        meeting.barrier.wait()  # no rank writes its next slot before every rank read this one
        meeting.turn.acquire()
        return gathered


@pytest.mark.parametrize("fmt", [INT8_TOKEN, FP8_BLOCK], ids=str)
def test_tensor_parallel_ranks_join_to_the_block(fmt):
    """Two ranks: gate/up 128 of each expert's 256 rows, down 64 of its 128 output rows
    over the gathered 256 inputs (rank 1's start inside an FP8 block of 128 rows); their
    outputs summed (the block's all-reduce) are one rank's, int8 bit for bit, each rank
    holding about half the bytes."""
    tensors = _tensors(fmt)
    whole = _experts(fmt, tensors)
    x, (ids, weights) = hidden_states(9, HIDDEN), routing(9, [0, 1, 2, 3])
    meeting = _Meeting(2)
    ranks = [_experts(fmt, tensors, _ThreadedGroup(rank, 2, meeting)) for rank in range(2)]
    for layer in ranks:
        assert layer.gate_up[0].out_features == INTERMEDIATE  # its 128 gate and 128 up rows
        assert layer.down[0].out_features == HIDDEN // 2
        assert layer.weight_bytes() <= 0.55 * whole.weight_bytes()
    with ThreadPoolExecutor(2) as pool:
        partials = list(pool.map(lambda r: meeting.run(lambda: r(x, ids, weights)), ranks))
    want = whole(x, ids, weights)
    if fmt is INT8_TOKEN:
        assert torch.equal(partials[0] + partials[1], want)
    else:  # torch.mm's sums follow the band's shape
        torch.testing.assert_close(partials[0] + partials[1], want, rtol=1e-5, atol=1e-6)


def test_experts_quantized_in_part_are_refused_by_name():
    tensors = _tensors(INT8_TOKEN)
    del tensors[(2, "down")]
    with pytest.raises(ValueError, match=r"not \(expert, shard\) \[\(2, 'down'\)\]"):
        _experts(INT8_TOKEN, tensors)


def test_a_quantized_router_is_refused_by_name(tmp_path):
    """The tools leave the router unquantized; a checkpoint that quantizes it is refused,
    not read as an expert."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from pagedllm.model.layers.w8a8_swap import keep_w8a8_weights
    from pagedllm.model.registry import resolve_model_class
    from pagedllm.ops.attention_registry import get_attention_backend

    config = AutoConfig.for_model(
        "qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
    )  # fmt: skip
    model = resolve_model_class(config.architectures)(
        config, get_attention_backend("torch"), torch.float32, 256
    )
    router = quantize_weight(torch.randn(EXPERTS, 64), INT8_TOKEN)
    router_tensors = {f"model.layers.0.mlp.gate.{n}": t for n, t in router.items()}
    save_file(router_tensors, tmp_path / "model.safetensors")
    scheme = checkpoint_scheme(INT8_TOKEN.method, INT8_TOKEN.quantization_config())
    named = r"'model\.layers\.0\.mlp\.gate'.*MoE routers .* not served"
    with pytest.raises(ValueError, match=named):
        keep_w8a8_weights(model, str(tmp_path), scheme)


# ---- whole models ---------------------------------------------------------------------------
# Each expert 256 x 256: whole FP8 blocks and activation groups of 128.
MODEL_SHAPES = {
    "MixtralForCausalLM": dict(hidden_size=256, intermediate_size=256, head_dim=64),
    # Layers 0 and 2 sparse, layer 1 a dense MLP of intermediate_size.
    "Qwen3MoeForCausalLM": dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=256, head_dim=64
    ),
}
# name -> (architecture, format, dense 8-bit layers (parts of fused ones counted apiece))
CHECKPOINTS = {
    "mixtral-ct-int8-token": ("MixtralForCausalLM", INT8_TOKEN, 2 * 2),
    "qwen3-moe-ct-fp8-dynamic": ("Qwen3MoeForCausalLM", FP8_DYNAMIC, 3 * 2 + 2),
    "mixtral-fp8-block": ("MixtralForCausalLM", FP8_BLOCK, 2 * 2),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """architecture -> the tiny fp32 model, written once."""
    return {
        arch: make_tiny_model(arch, tmp_path_factory.mktemp(arch), **shape)
        for arch, shape in MODEL_SHAPES.items()
    }


def _expert_bytes(quantized) -> int:
    """The checkpoint's bytes of the experts' tensors."""
    from safetensors import safe_open

    with safe_open(str(quantized / "model.safetensors"), framework="pt") as checkpoint:
        names = [n for n in checkpoint.keys() if ".experts." in n]  # noqa: SIM118 (no __iter__)
        return sum(checkpoint.get_tensor(n).nbytes for n in names)


def _transformers_greedy(dequantized, fmt, prompts: list[list[int]]) -> list:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    add_activation_quantization(hf_model, fmt)
    assert add_expert_activation_quantization(hf_model, fmt) == 2  # every sparse layer's
    return [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_moe_checkpoint_serves_transformers_tokens_on_8_bit_experts(
    sources, tmp_path, report_ties, name
):
    architecture, fmt, dense_layers = CHECKPOINTS[name]
    quantized, dequantized = tmp_path / "w8a8", tmp_path / "dequantized"
    write_w8a8_checkpoint(sources[architecture], quantized, dequantized, fmt, MOE_LAYERS)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (5, 19, 33)]
    references = _transformers_greedy(dequantized, fmt, prompts)
    llm = LLM(str(quantized), max_model_len=128, kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ties = sum(
        compare_greedy(out.outputs[0].token_ids, ref, TIE_TOLERANCE)
        for out, ref in zip(outputs, references, strict=True)
    )
    report_ties(ties, len(prompts))
    model = model_runner(llm).model
    experts = [m for m in model.modules() if isinstance(m, W8A8GroupedExperts)]
    assert len(experts) == 2  # every sparse layer's
    dense = [m for m in model.modules() if isinstance(m, (Int8W8A8Linear, TiledDequantLinear))]
    assert len(dense) == dense_layers + 2 * EXPERTS * 2  # each expert's gate/up and down
    held, stored = sum(e.weight_bytes() for e in experts), _expert_bytes(quantized)
    print(f"{name}: experts checkpoint {stored} B, held {held} ({held / stored:.3f}x)")
    assert 0.9 * stored <= held <= 1.1 * stored
    # No fp32 copy of an expert: the largest parameter left is a router's [experts, hidden].
    hidden = MODEL_SHAPES[architecture]["hidden_size"]
    assert max(p.numel() for n, p in model.named_parameters() if "layers" in n) <= EXPERTS * hidden


def test_dummy_weights_put_the_experts_on_random_8_bit_layers(sources, tmp_path):
    """A config.json alone with an int8 W8A8 quantization_config and load_format="dummy":
    every sparse layer's experts 8-bit, no fp32 expert left, and the model generates."""
    import json
    import math

    from pagedllm.model.loader import write_config_dir

    config = json.loads((sources["Qwen3MoeForCausalLM"] / "config.json").read_text())
    config["quantization_config"] = INT8_TOKEN.quantization_config()
    shapes = write_config_dir(str(tmp_path / "shape-only"), config)
    dummy = {"load_format": "dummy", "skip_tokenizer_init": True}
    llm = LLM(str(shapes), max_model_len=128, kv_cache_memory="8MiB", **dummy)
    model = model_runner(llm).model
    experts = [m for m in model.modules() if isinstance(m, W8A8GroupedExperts)]
    assert len(experts) == 2  # layer 1 is dense
    assert all(isinstance(layer, Int8W8A8Linear) for e in experts for layer in e.down)
    hidden = MODEL_SHAPES["Qwen3MoeForCausalLM"]["hidden_size"]
    assert max(p.numel() for n, p in model.named_parameters() if "layers" in n) <= EXPERTS * hidden
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    (output,) = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8
    assert all(
        math.isfinite(lp.logprob) for step in output.outputs[0].logprobs for lp in step.values()
    )


def test_the_load_log_counts_what_8_bit_modules_hold(caplog):
    """fbgemm's prepacked int8 weights are held outside a module's buffers: the log counts a
    module's own `weight_bytes` where it has one, and its buffers otherwise."""

    class Prepacked(torch.nn.Module):
        def weight_bytes(self) -> int:
            return 7_000_000

    class Scheme:
        def describe(self) -> str:
            return "int8 per-channel"

    model = torch.nn.Module()
    model.experts = Prepacked()
    model.dense = torch.nn.Module()
    model.dense.register_buffer("values", torch.zeros(1_000_000, dtype=torch.int8))
    logger = logging.getLogger("pagedllm")  # it does not propagate to the root logger
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="pagedllm"):
            log_w8a8_layers(model, ["experts", "dense"], Scheme(), "checkpoint")
    finally:
        logger.removeHandler(caplog.handler)
    assert "checkpoint 8-bit layers (int8 per-channel): 2 modules (8 MB)" in caplog.text
