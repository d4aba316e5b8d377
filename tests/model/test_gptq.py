"""GPTQ 4-bit checkpoints served on their packed weights: the reader's dequantization equals
the format's own exactly, the kernel layer multiplies by those weights, the weights held in
memory are the checkpoint's bytes within 10% (groups of 32, 128 and per channel), and the engine's
greedy tokens are Transformers' on the same model with the dequantized weights, for groups
of 32 / 128 / per channel, with and without act-order, symmetric or not."""

from __future__ import annotations

import math

import pytest
import torch
from gptq_writer import (
    Scheme,
    quantize_weight,
    reference_dequantize,
    write_gptq_checkpoint,
)
from model_utils import compare_greedy, hf_greedy, model_runner
from quantized_llama import (
    SHAPE,
    draft_for_the_dequantized_model,
    make_quantizable_llama,
    once_per_scheme,
)

from pagedllm import LLM, SamplingParams
from pagedllm.model.layers.gguf_linear import GGUFConcatLinear
from pagedllm.model.layers.gptq_linear import GPTQLinear, merged_gptq_layer
from pagedllm.model.quantization.gptq import GPTQConfig
from pagedllm.model.quantization.gptq_format import GPTQTensors, unpack_gptq

SCHEMES = [
    Scheme(128, desc_act=False, sym=True),
    Scheme(32, desc_act=True, sym=False),
    Scheme(-1, desc_act=False, sym=False),
    Scheme(128, desc_act=True, sym=True, checkpoint_format="gptq_v2"),
]
TIE_TOLERANCE = 1e-3
MAX_NEW_TOKENS = 12


def _unpacked(weight: torch.Tensor, scheme: Scheme, seed: int = 0):
    tensors = quantize_weight(weight, scheme, torch.Generator().manual_seed(seed))
    config = GPTQConfig.from_dict(scheme.quantization_config())
    return tensors, unpack_gptq(GPTQTensors(**tensors), config)


@pytest.mark.parametrize("scheme", [*SCHEMES, Scheme(64, desc_act=True, sym=False)], ids=str)
def test_dequantized_weights_are_the_formats_exactly(scheme):
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    tensors, unpacked = _unpacked(weight, scheme)
    reference = reference_dequantize(tensors, scheme)
    assert torch.equal(unpacked.dequantize(), reference)
    assert (unpacked.order is not None) == scheme.desc_act
    # The round trip is a quantization of the weight (a wrong layout would be far off).
    assert (reference - weight).abs().max() < 0.2 * weight.abs().max()


def test_v1_zero_points_are_stored_minus_one():
    """The same weights in both layouts: v1's stored zero points are v2's minus 1."""
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    v1, _ = _unpacked(weight, Scheme(32, False, False, "gptq"))
    v2, _ = _unpacked(weight, Scheme(32, False, False, "gptq_v2"))
    assert torch.equal(v1["qweight"], v2["qweight"])
    nibble = lambda z: z & 0xF  # noqa: E731 (the lowest packed zero point)
    assert torch.equal(nibble(v1["qzeros"] + 1), nibble(v2["qzeros"]))


def test_zero_points_not_packed_are_refused_not_trimmed():
    """qzeros int32 [G, N] (one zero point a word) would unpack to [G, 8N]; its first N
    columns are other values, so the shape is checked before anything is cut."""
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    scheme = Scheme(32, False, False, "gptq_v2")
    tensors = quantize_weight(weight, scheme, torch.Generator().manual_seed(0))
    tensors["qzeros"] = torch.full((2, 16), 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="qzeros"):
        unpack_gptq(GPTQTensors(**tensors), GPTQConfig.from_dict(scheme.quantization_config()))


@pytest.mark.parametrize("isa", [0, 1, 2], ids=["portable", "avx2", "vnni"])
@pytest.mark.parametrize("scheme", SCHEMES[:3], ids=str)
def test_layer_multiplies_by_the_dequantized_weights(scheme, isa):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 256, generator=generator)
    _, unpacked = _unpacked(weight, scheme)
    layer = GPTQLinear(unpacked)
    layer.isa = isa  # lowered to what this CPU has
    x = torch.randn(5, 256, generator=generator)
    expected = x @ unpacked.dequantize().T
    # Two int8 digits per input block: ~15 bits, the only approximation.
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-3)


def test_fused_parts_with_their_own_act_orders_are_one_layer_each():
    generator = torch.Generator().manual_seed(4)
    scheme = Scheme(64, desc_act=True, sym=False)
    weights = [torch.randn(rows, 128, generator=generator) for rows in (32, 16)]
    parts = [_unpacked(weight, scheme, seed=len(weight))[1] for weight in weights]
    layer = merged_gptq_layer(parts, [32, 16], None)
    assert isinstance(layer, GGUFConcatLinear)
    x = torch.randn(3, 128, generator=generator)
    expected = x @ torch.cat([p.dequantize() for p in parts]).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-3)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_quantizable_llama(tmp_path_factory)


def _checkpoints(tiny_llama, tmp_path, scheme):
    quantized, dequantized = tmp_path / "gptq", tmp_path / "dequantized"
    gptq_bytes = write_gptq_checkpoint(tiny_llama, quantized, dequantized, scheme)
    return quantized, dequantized, gptq_bytes


@pytest.fixture(scope="module")
def written(tiny_llama, tmp_path_factory):
    """scheme -> the tiny Llama's checkpoint in it, written once for the tests that read it."""
    return once_per_scheme(
        lambda scheme: _checkpoints(tiny_llama, tmp_path_factory.mktemp("gptq"), scheme)
    )


@pytest.fixture(scope="module")
def served(written):
    """scheme -> an engine on the tiny Llama's checkpoint in it, shared by the tests that read
    its layers and its tokens (starting one is most of a test's time)."""
    return once_per_scheme(
        lambda scheme: LLM(str(written(scheme)[0]), max_model_len=128, kv_cache_memory="8MiB")
    )


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_greedy_tokens_are_transformers_on_the_dequantized_model(written, served, scheme):
    from transformers import AutoModelForCausalLM

    _, dequantized, _ = written(scheme)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (5, 19, 33)]
    hf_model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    references = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    llm = served(scheme)
    assert llm.llm_engine.model_config.quantization == "gptq"
    assert any(isinstance(m, GPTQLinear) for m in model_runner(llm).model.modules())
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ties = sum(
        compare_greedy(out.outputs[0].token_ids, ref, TIE_TOLERANCE)
        for out, ref in zip(outputs, references, strict=True)
    )
    print(f"{scheme}: ties {ties}")


@pytest.mark.parametrize(
    ("scheme", "most"),
    # Groups of 32 keep the fp16 scale and a uint8 zero point (none when symmetric) per
    # group and column: 3 bytes where the checkpoint stores 2.5.
    [
        (Scheme(128, False, True), 1.10),
        (Scheme(128, True, False), 1.10),  # q/k/v and gate/up: one layer per part
        (Scheme(-1, False, False), 1.10),
        (Scheme(32, False, False), 1.10),
        (Scheme(32, False, True), 1.10),
    ],
    ids=str,
)
def test_weights_in_memory_are_the_checkpoints_bytes(written, served, scheme, most):
    gptq_bytes = written(scheme)[2]
    model = model_runner(served(scheme)).model
    layers = [m for m in model.modules() if isinstance(m, GPTQLinear)]
    # qkv, o, gate_up, down in each of 2 layers; with act-order q, k, v, gate, up apart.
    assert len(layers) == 2 * (7 if scheme.desc_act else 4)
    held = sum(layer.weight_bytes() for layer in layers)
    print(f"{scheme}: checkpoint {gptq_bytes} bytes, held {held} ({held / gptq_bytes:.3f}x)")
    assert 0.9 * gptq_bytes <= held <= most * gptq_bytes
    # No fp32 copy of a quantized weight is left behind.
    largest = max(p.numel() for n, p in model.named_parameters() if "layers" in n)
    assert largest <= SHAPE["hidden_size"]


@pytest.mark.parametrize(
    ("engine_args", "named"),
    [
        ({"dtype": "bfloat16"}, "with dtype='bfloat16'"),
        ({"quantization": "int8"}, "quantization='int8' disagrees"),
    ],
)
def test_combinations_not_served_are_refused_by_name(written, engine_args, named):
    quantized, _, _ = written(Scheme(128, False, True))
    with pytest.raises(ValueError, match=named):
        LLM(str(quantized), max_model_len=128, kv_cache_memory="8MiB", **engine_args)


def test_a_draft_model_stored_quantized_runs_on_its_packed_weights(written):
    """The GPTQ checkpoint drafting for the fp32 model it was dequantized into: the draft runs
    on packed layers, the target's greedy tokens are unchanged, and nearly every draft is
    accepted (the two differ only by the kernel's 16-bit activations)."""
    quantized, dequantized, _ = written(Scheme(128, True, False))

    def check_draft(model) -> None:
        assert any(isinstance(m, GPTQLinear) for m in model.modules())

    llm, ties = draft_for_the_dequantized_model(quantized, dequantized, check_draft, TIE_TOLERANCE)
    print(f"ties {ties}")
    counts = llm.get_stats().spec_decode
    assert counts.num_drafts > 0
    assert counts.num_accepted_tokens >= 0.9 * counts.num_draft_tokens


def test_dummy_weights_are_random_packed_layers_of_the_checkpoints_shapes(
    written, served, tmp_path
):
    """A config.json alone with load_format="dummy": the same packed layers, holding the same
    bytes, as the checkpoint of that config; the model generates."""
    import json

    from pagedllm.model.loader import write_config_dir

    scheme = Scheme(128, desc_act=True, sym=False)
    quantized, _, _ = written(scheme)
    config = json.loads((quantized / "config.json").read_text())
    shapes = write_config_dir(str(tmp_path / "shape-only"), config)
    dummy = {"load_format": "dummy", "skip_tokenizer_init": True}
    held = {}
    for name, llm in (
        ("checkpoint", served(scheme)),
        ("dummy", LLM(str(shapes), max_model_len=128, kv_cache_memory="8MiB", **dummy)),
    ):
        layers = [m for m in model_runner(llm).model.modules() if isinstance(m, GPTQLinear)]
        held[name] = [(layer.extra_repr(), layer.weight_bytes()) for layer in layers]
    assert held["dummy"] == held["checkpoint"] and len(held["dummy"]) == 2 * 7
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    (output,) = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8
    assert all(
        math.isfinite(lp.logprob) for step in output.outputs[0].logprobs for lp in step.values()
    )
