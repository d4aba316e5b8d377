"""8-bit checkpoints (compressed-tensors int8 W8A8 and FP8, `quant_method` "fp8") served on
their 8-bit weights: the reader's dequantization is the format's exactly, each layer
computes the reference math (dequantized weights times the fake-quantized activation)
within fp32 rounding on every kernel path, the weights held in memory are the checkpoint's
bytes within 10%, and the engine's greedy tokens are Transformers' on the dequantized model
with the same activation quantization; an 8-bit draft model keeps its target's tokens. A
mixture's 8-bit experts: tests/model/test_w8a8_moe.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from model_utils import compare_greedy, hf_greedy, make_tiny_model, model_runner
from quantized_llama import (
    SHAPE,
    draft_for_the_dequantized_model,
    make_quantizable_llama,
    once_per_scheme,
)
from w8a8_writer import (
    FORMATS,
    Format,
    add_activation_quantization,
    fake_quantize_activation,
    quantize_weight,
    reference_dequantize,
    write_w8a8_checkpoint,
)

import pagedllm.model.layers.w8a8_linear as w8a8_linear
import pagedllm.model.layers.w8a8_weights as w8a8_weights
from pagedllm import LLM, SamplingParams
from pagedllm.model.layers.gguf_linear import GGUFConcatLinear
from pagedllm.model.layers.linear import MergedLinear
from pagedllm.model.layers.packed_dummy import WEIGHT_STD
from pagedllm.model.layers.w8a8_linear import Int8W8A8Linear, TiledDequantLinear
from pagedllm.model.layers.w8a8_swap import _w8a8_layer, checkpoint_scheme, layer_weights

TIE_TOLERANCE = 1e-3
MAX_NEW_TOKENS = 12


def _weights(weight: torch.Tensor, fmt: Format):
    tensors = quantize_weight(weight, fmt)
    scheme = checkpoint_scheme(fmt.method, fmt.quantization_config())
    return tensors, layer_weights("layer", tensors, scheme)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.activations == "group"], ids=str)
def test_a_layer_whose_inputs_are_not_whole_activation_groups_is_refused_at_load(fmt):
    """Activations are scaled per group of 128 inputs: 200 inputs would load and then fail
    the first forward (the engine's first request), so the layer is refused by name."""
    tensors = quantize_weight(torch.randn(64, 200, generator=torch.Generator()), fmt)
    scheme = checkpoint_scheme(fmt.method, fmt.quantization_config())
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: 200 inputs.*of 128"):
        layer_weights("model.layers.0.mlp.down_proj", tensors, scheme)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_dequantized_weights_are_the_formats_exactly(fmt):
    # 300 outputs: a last block of rows cut short.
    weight = torch.randn(300, 256, generator=torch.Generator().manual_seed(1))
    tensors, weights = _weights(weight, fmt)
    reference = reference_dequantize(tensors, fmt)
    assert torch.equal(weights.dequantize(), reference)
    assert torch.equal(weights.dequantize_rows(100, 230), reference[100:230])
    # The round trip is a quantization of the weight (a wrong layout would be far off).
    assert (reference - weight).abs().max() < 0.1 * weight.abs().max()


def test_the_fp8_kernel_decodes_every_code_as_torch_does():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    values = codes.reshape(8, 32)
    out = torch.empty(8, 32)
    w8a8_weights.fp8_kernel()(out, values, torch.ones(8, 1), 1, 32)
    # Subnormals, both zeros and the two NaNs (0x7F, 0xFF) included.
    torch.testing.assert_close(out, values.float(), rtol=0, atol=0, equal_nan=True)
    assert torch.signbit(out.view(-1)[128])  # -0.0


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.weight_type == "float"], ids=str)
def test_the_fp8_kernel_dequantizes_as_the_torch_path(fmt, monkeypatch):
    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(2))  # cut blocks
    # Weight-only: 200 inputs are no whole activation groups, but blocks of weights may be cut.
    scheme = replace(checkpoint_scheme(fmt.method, fmt.quantization_config()), activations=None)
    weights = layer_weights("layer", quantize_weight(weight, fmt), scheme)
    by_kernel = weights.dequantize()
    monkeypatch.setattr(w8a8_weights, "_KERNEL", [None])  # where the extension is missing
    assert torch.equal(by_kernel, weights.dequantize())


def _expected(x: torch.Tensor, weight: torch.Tensor, fmt: Format) -> torch.Tensor:
    activation = x if fmt.activations is None else fake_quantize_activation(x, fmt)
    return activation.double() @ weight.double().T


def _on_int8_gemm(fmt: Format) -> bool:
    return fmt.weight_type == "int" and fmt.activations is not None


# The int8 GEMM's two paths: fbgemm (VNNI CPUs) and torch._int_mm (the others).
KERNEL_CASES = [
    pytest.param(fmt, on_fbgemm, id=f"{fmt}-{kernel}")
    for fmt in FORMATS
    for on_fbgemm, kernel in ((True, "fbgemm"), (False, "int_mm"))
    if _on_int8_gemm(fmt) or on_fbgemm
]


# fp8: up to fused_max_rows() rows multiplied in registers, more through bands and torch.mm.
FUSED_ROWS = w8a8_linear.fused_max_rows()


@pytest.mark.parametrize("rows", [FUSED_ROWS - 1, FUSED_ROWS + 2])
@pytest.mark.parametrize(("fmt", "on_fbgemm"), KERNEL_CASES)
def test_layer_computes_the_reference_math(fmt, on_fbgemm, rows, monkeypatch):
    # Without VNNI fbgemm is not exact on full-range inputs; the fallback is what runs there.
    on_fbgemm = on_fbgemm and w8a8_linear.use_fbgemm()
    monkeypatch.setattr(w8a8_linear, "use_fbgemm", lambda: on_fbgemm)
    generator = torch.Generator().manual_seed(3)
    tensors, weights = _weights(torch.randn(300, 256, generator=generator), fmt)
    layer = w8a8_linear.w8a8_layer(weights)
    assert isinstance(layer, Int8W8A8Linear if _on_int8_gemm(fmt) else TiledDequantLinear)
    if _on_int8_gemm(fmt):
        assert (layer._packed is not None) == on_fbgemm
    if isinstance(layer, TiledDequantLinear):
        layer.band_rows = 128  # several bands, the last one short
    # A first token 30x the others, as real first tokens are: per-token scales keep theirs.
    x = torch.randn(rows, 256, generator=generator) * 0.3
    x[0] *= 30
    expected = _expected(x, reference_dequantize(tensors, fmt), fmt)
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-4)


def test_a_band_layer_runs_outside_inference_mode_after_a_step_inside_it(monkeypatch):
    # The band buffer is shared by every layer; first made in an engine step (under
    # inference mode), it must still take writes when a layer is called directly.
    monkeypatch.setattr(w8a8_linear, "_SCRATCH", [torch.empty(0)])
    fmt = FORMATS[2]  # int8 weight-only: bands of dequantized rows
    generator = torch.Generator().manual_seed(5)
    _, weights = _weights(torch.randn(300, 256, generator=generator), fmt)
    layer = w8a8_linear.w8a8_layer(weights)
    assert isinstance(layer, TiledDequantLinear)
    x = torch.randn(6, 256, generator=generator)
    with torch.inference_mode():
        inside = layer(x).clone()
    assert torch.equal(layer(x), inside)


def test_fused_parts_whose_blocks_do_not_stack_are_one_layer_each():
    fmt = Format("fp8-block", "fp8", "float", "block", "group")
    generator = torch.Generator().manual_seed(4)
    parts = {
        s: _weights(torch.randn(n, 256, generator=generator), fmt)
        for s, n in (("q", 96), ("k", 128))
    }

    fused = MergedLinear(256, [96, 128], ["q", "k"], bias=False, dtype=torch.float32)
    layer = _w8a8_layer("qk", fused, {s: w for s, (_, w) in parts.items()})
    assert isinstance(layer, GGUFConcatLinear)  # 96 rows are not whole blocks of 128
    x = torch.randn(3, 256, generator=generator)
    weight = torch.cat([reference_dequantize(t, fmt) for t, _ in parts.values()])
    torch.testing.assert_close(layer(x).double(), _expected(x, weight, fmt), rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_quantizable_llama(tmp_path_factory)


def _checkpoints(tiny_llama, tmp_path, fmt):
    quantized, dequantized = tmp_path / "w8a8", tmp_path / "dequantized"
    checkpoint_bytes = write_w8a8_checkpoint(tiny_llama, quantized, dequantized, fmt)
    return quantized, dequantized, checkpoint_bytes


@pytest.fixture(scope="module")
def written(tiny_llama, tmp_path_factory):
    """fmt -> the tiny Llama's checkpoint in it, written once for the tests that read it."""
    return once_per_scheme(
        lambda fmt: _checkpoints(tiny_llama, tmp_path_factory.mktemp(str(fmt)), fmt)
    )


@pytest.fixture(scope="module")
def served(written):
    """fmt -> an engine on the tiny Llama's checkpoint in it, shared by the tests that read
    its layers and its tokens (starting one is most of a test's time)."""
    return once_per_scheme(lambda fmt: _engine(written(fmt)[0], fmt))


def _engine(quantized, fmt: Format) -> LLM:
    # A per-tensor dynamic scale spans the whole batch: one sequence at a time, as the
    # reference runs them.
    seqs = 1 if fmt.activations == "tensor" else 8
    return LLM(str(quantized), max_model_len=128, kv_cache_memory="8MiB", max_num_seqs=seqs)


def _assert_greedy_tokens_match(dequantized, llm: LLM, fmt: Format) -> None:
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (5, 19, 33)]
    hf_model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32)
    add_activation_quantization(hf_model, fmt)
    references = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    assert llm.llm_engine.model_config.quantization == fmt.method
    layer_class = Int8W8A8Linear if _on_int8_gemm(fmt) else TiledDequantLinear
    assert sum(isinstance(m, layer_class) for m in model_runner(llm).model.modules()) == 8
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ties = sum(
        compare_greedy(out.outputs[0].token_ids, ref, TIE_TOLERANCE)
        for out, ref in zip(outputs, references, strict=True)
    )
    print(f"{fmt}: ties {ties}")


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_greedy_tokens_are_transformers_with_the_same_quantization(written, served, fmt):
    _assert_greedy_tokens_match(written(fmt)[1], served(fmt), fmt)


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[5]], ids=str)
def test_projections_with_biases_keep_them(tmp_path, fmt):
    """Qwen2's q/k/v have biases: the fused 8-bit layer adds the checkpoint's."""
    from safetensors.torch import load_file, save_file

    qwen2 = make_tiny_model("Qwen2ForCausalLM", tmp_path / "qwen2", **SHAPE)
    state = load_file(qwen2 / "model.safetensors")
    generator = torch.Generator().manual_seed(6)
    biases = [name for name in state if name.endswith("_proj.bias")]
    assert biases  # initialised to zero: made random so that a lost bias shows
    for name in biases:
        state[name] = torch.randn(state[name].shape, generator=generator)
    save_file(state, qwen2 / "model.safetensors")
    _, dequantized, _ = _checkpoints(qwen2, tmp_path, fmt)
    _assert_greedy_tokens_match(dequantized, _engine(tmp_path / "w8a8", fmt), fmt)


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3], FORMATS[6]], ids=str)
def test_weights_in_memory_are_the_checkpoints_bytes(written, served, fmt):
    checkpoint_bytes = written(fmt)[2]
    model = model_runner(served(fmt)).model
    layers = [m for m in model.modules() if isinstance(m, (Int8W8A8Linear, TiledDequantLinear))]
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    held = sum(layer.weight_bytes() for layer in layers)
    print(
        f"{fmt}: checkpoint {checkpoint_bytes} bytes, held {held} ({held / checkpoint_bytes:.3f}x)"
    )
    assert 0.9 * checkpoint_bytes <= held <= 1.1 * checkpoint_bytes
    # No fp32 copy of a quantized weight is left behind.
    largest = max(p.numel() for n, p in model.named_parameters() if "layers" in n)
    assert largest <= SHAPE["hidden_size"]


@pytest.mark.parametrize(
    ("engine_args", "named"),
    [
        ({"dtype": "bfloat16"}, "with dtype='bfloat16'"),
        ({"quantization": "fp8"}, "quantization='fp8' disagrees"),
    ],
)
def test_combinations_not_served_are_refused_by_name(written, engine_args, named):
    quantized, _, _ = written(FORMATS[0])
    with pytest.raises(ValueError, match=named):
        LLM(str(quantized), max_model_len=128, kv_cache_memory="8MiB", **engine_args)


# The share of drafts accepted at least: int8 activations keep ~8 bits of each value, fp8
# e4m3 ones 4 (fp8 blocks: 48 of 60 measured when this was written, 47 of 63 on an AVX2 EPYC,
# where the fp32 target sums in another order; int8: 51 of 51 on both). ~60 drafts accepted
# at 0.78 vary by ~0.05, so the fp8 floor sits two of those below; a draft that lost its
# layers' meaning would accept almost nothing.
@pytest.mark.parametrize(
    ("fmt", "least_accepted"), [(FORMATS[0], 0.9), (FORMATS[6], 0.68)], ids=str
)
def test_a_draft_model_on_8_bit_layers_keeps_the_targets_tokens(written, fmt, least_accepted):
    """The 8-bit checkpoint drafting for the fp32 model it was dequantized into: the draft
    runs on its 8-bit layers, the target's greedy tokens are unchanged, and most drafts
    are accepted (the two differ only by the draft's quantized activations)."""
    quantized, dequantized, _ = written(fmt)
    layer_class = Int8W8A8Linear if _on_int8_gemm(fmt) else TiledDequantLinear

    def check_draft(model) -> None:
        assert sum(isinstance(m, layer_class) for m in model.modules()) == 2 * 4

    llm, ties = draft_for_the_dequantized_model(quantized, dequantized, check_draft, TIE_TOLERANCE)
    print(f"{fmt}: ties {ties}")
    counts = llm.get_stats().spec_decode
    print(f"{fmt}: accepted {counts.num_accepted_tokens} of {counts.num_draft_tokens}")
    assert counts.num_drafts > 0
    assert counts.num_accepted_tokens >= least_accepted * counts.num_draft_tokens


def _eight_bit_layers(llm: LLM) -> list:
    layers = (Int8W8A8Linear, TiledDequantLinear)
    return [m for m in model_runner(llm).model.modules() if isinstance(m, layers)]


# int8 per channel, fp8 per tensor with a static input scale, fp8 blocks ("fp8" config).
@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[4], FORMATS[6]], ids=str)
def test_dummy_weights_are_random_8_bit_layers_of_the_checkpoints_shapes(
    written, served, tmp_path, fmt
):
    """A config.json alone with load_format="dummy": the same 8-bit layers (class, scheme,
    shape), holding the checkpoint's bytes within 10%, of the order of the loader's dummy
    weights; the model generates."""
    import json
    import math

    from pagedllm.model.loader import write_config_dir

    quantized, _, checkpoint_bytes = written(fmt)
    config = json.loads((quantized / "config.json").read_text())
    dummy = LLM(
        write_config_dir(str(tmp_path / "shape-only"), config), max_model_len=128,
        kv_cache_memory="8MiB", load_format="dummy", skip_tokenizer_init=True,
    )  # fmt: skip
    held = {
        name: [(type(m), m.extra_repr()) for m in _eight_bit_layers(llm)]
        for name, llm in (("checkpoint", served(fmt)), ("dummy", dummy))
    }
    assert held["dummy"] == held["checkpoint"] and len(held["dummy"]) == 2 * 4
    dummy_bytes = sum(layer.weight_bytes() for layer in _eight_bit_layers(dummy))
    assert 0.9 * checkpoint_bytes <= dummy_bytes <= 1.1 * checkpoint_bytes
    # Weights of std ~0.02 (the loader's dummy N(0, 0.02)) give outputs of std 0.02 sqrt(K)
    # from unit inputs.
    o_proj = model_runner(dummy).model.get_submodule("model.layers.0.self_attn.o_proj")
    x = torch.randn(16, o_proj.in_features, generator=torch.Generator().manual_seed(7))
    expected_std = WEIGHT_STD * o_proj.in_features**0.5
    assert 0.5 * expected_std < o_proj(x).std().item() < 2 * expected_std
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    (output,) = dummy.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8
    logprobs = [lp.logprob for step in output.outputs[0].logprobs for lp in step.values()]
    assert all(math.isfinite(lp) for lp in logprobs)


def test_a_dummy_draft_stored_8_bit_runs_on_random_8_bit_layers(tiny_llama, written):
    """A draft's checkpoint method takes dummy weights as a target's does: its projections
    are random 8-bit layers, and the pair generates."""
    quantized, _, _ = written(FORMATS[6])
    draft = {"method": "draft_model", "model": str(quantized), "num_speculative_tokens": 3}
    llm = LLM(
        str(tiny_llama), load_format="dummy", speculative_config=draft, max_model_len=128,
        kv_cache_memory="8MiB", skip_tokenizer_init=True,
    )  # fmt: skip
    assert llm.llm_engine.model_config.quantization is None
    draft_model = model_runner(llm).proposer.model
    assert sum(isinstance(m, TiledDequantLinear) for m in draft_model.modules()) == 2 * 4
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (output,) = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8
    assert llm.get_stats().spec_decode.num_drafts > 0


def test_dummy_fp8_layers_honour_ignored_layers_and_modules_to_not_convert():
    """vLLM's fp8 configs name the layers a checkpoint keeps unquantized in `ignored_layers`
    (whole names) or `modules_to_not_convert` (parts of names); dummy weights skip both."""
    from pagedllm.model.layers.w8a8_dummy import is_quantized_projection

    config = {
        "quant_method": "fp8",
        "ignored_layers": ["model.layers.0.mlp.down_proj"],
        "modules_to_not_convert": ["o_proj"],
    }
    assert not is_quantized_projection("fp8", config, "model.layers.0.mlp.down_proj")
    assert not is_quantized_projection("fp8", config, "model.layers.1.self_attn.o_proj")
    assert is_quantized_projection("fp8", config, "model.layers.1.mlp.down_proj")
    assert is_quantized_projection("fp8", config, "model.layers.0.mlp.gate_proj")
