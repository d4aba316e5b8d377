"""`quantization="gguf"`: GGUF blocks read as the file stores them (K-quants included), the
block kernel against a float reference (AMX, VNNI, AVX2 and portable paths bit for bit), which
layers it replaces, greedy output against the fp32 engine on a tiny GGUF Llama, and refused
settings."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import tiny_model, write_model_gguf
from model_utils import (
    assert_bit_equal_to_reference,
    compare_to_reference_engine,
    greedy_with_logprobs,
    model_runner,
)

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.model.layers.gguf_embedding import GGUFEmbedding
from pagedllm.model.layers.gguf_linear import (
    GGUFConcatLinear,
    GGUFLinear,
    GGUFMergedLinear,
    as_kernel_type,
    kernel_type_of_run,
    pack_gguf,
    reference_pack_gguf,
    unpack_blocks,
    unpack_k_blocks,
)
from pagedllm.model.layers.linear import Linear
from pagedllm.ops import extension
from pagedllm.ops.cpu_features import (
    GGUF_AMX,
    GGUF_AVX2,
    GGUF_PORTABLE,
    GGUF_VNNI,
    CpuFeatures,
    describe_cpu,
    gguf_kernel_isa,
)

KERNEL_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0]
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Offsets of the fp16 super-block scales in a K-quant block: d (and dmin).
K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
# Every kernel path this CPU can run: 0 portable, 1 AVX2, 2 AVX-512 VNNI, 3 AMX-INT8 tiles.
PATHS = list(range(gguf_kernel_isa() + 1))
NUM_PROMPTS, MAX_TOKENS = 12, 24
# Largest top-2 logprob gap at which the quantized engine may pick the other token. Two int8
# digits per activation (~15 bits) moved the tiny model's logprobs by 1.2e-5 at most (measured);
# a gap below 1e-3 is a tie at that precision.
TIE_TOLERANCE = 1e-3


def _raw(rows: int, cols: int, qtype: Q, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """A random weight quantized to `qtype`: (raw blocks [rows, bytes], dequantized fp32)."""
    weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    weight[3] *= 30  # one loud row: its blocks' scales must not leak into the others
    raw = gguf.quants.quantize(weight, qtype)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, cols))


def _raw_k(rows: int, cols: int, qtype: Q, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Random K-quant blocks (gguf cannot quantize to K-quants): random bytes with sensible
    fp16 super-block scales. (raw [rows, bytes], dequantized fp32)."""
    block_bytes, blocks = gguf.constants.GGML_QUANT_SIZES[qtype][1], cols // 256
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(1e-3, 3e-3, (rows, blocks)).astype(np.float16)
        scale[3] *= 30  # one loud row
        raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(rows, blocks, 2)
    raw = raw.reshape(rows, -1)
    weight = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    return raw, torch.from_numpy(weight.astype(np.float32))


def _any_raw(rows: int, cols: int, qtype: Q) -> tuple[np.ndarray, torch.Tensor]:
    return _raw_k(rows, cols, qtype) if qtype in K_TYPES else _raw(rows, cols, qtype)


def _activations(rows: int, cols: int) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    x[:, 7] *= 50  # an outlier channel, as in real hidden states
    return x


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_unpacked_blocks_are_the_dequantized_weights(qtype):
    raw, dequantized = _raw(12, 96, qtype)
    q, d, m = unpack_blocks(raw, qtype)
    assert q.max() <= {Q.Q8_0: 255, Q.Q5_0: 31}.get(qtype, 15)
    weights = q.reshape(12, 3, 32) * d[..., None] + m[..., None]
    np.testing.assert_allclose(weights.reshape(12, 96), dequantized.numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_unpacked_k_blocks_are_the_dequantized_weights(qtype):
    raw, dequantized = _raw_k(12, 512, qtype)
    k = unpack_k_blocks(raw, qtype)
    assert k.q.max() < 2 ** {Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6}[qtype]
    width = 512 // k.sub_sc.shape[1]
    per_sub = lambda t: np.repeat(t, 256 // width, axis=1)[..., None]  # noqa: E731
    d = per_sub(k.super_d) * k.sub_sc.reshape(12, -1, 1)
    m = per_sub(k.super_m) * k.sub_mn.reshape(12, -1, 1)
    weights = k.q.reshape(12, -1, width) * d + m
    np.testing.assert_allclose(weights.reshape(12, 512), dequantized.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", KERNEL_TYPES + K_TYPES)
def test_one_pass_packing_equals_the_reference(qtype):
    raw, _ = _any_raw(21, 512, qtype)  # 21 rows: the last tile is part padding
    packed, reference = pack_gguf(raw, qtype), reference_pack_gguf(raw, qtype)
    assert packed.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(packed[name], tensor), name
    if qtype == Q.Q6_K:
        assert packed["sub_mn"] is packed["sub_sc"]


@pytest.mark.parametrize("qtype", KERNEL_TYPES + K_TYPES)
@pytest.mark.parametrize(
    ("rows", "out_features"),
    [(1, 20), (4, 20), (5, 20), (9, 20), (15, 14), (23, 52), (16, 14), (40, 52), (144, 20)],
)
def test_kernel_matches_the_float_reference(qtype, rows, out_features):
    # Output columns in tiles of 8, paired on the VNNI and AMX paths: 20 is a pair and an odd
    # tile, 14 a pair whose second tile is part padding (never written out), 52 an item of two
    # pairs and one of a pair and an odd partial tile. Rows: passes of 8 and what is left (4,
    # 2, 1); on the AMX path groups of 16 (one, two, nine: more than a pass over a pair's
    # blocks takes) and the rows after them on the VNNI body.
    cols = 512 if qtype in K_TYPES else 96
    raw, weight = _any_raw(out_features, cols, qtype)
    bias = torch.randn(out_features)
    layer = GGUFLinear(raw, qtype, bias)
    x = _activations(rows, cols)
    exact = x.double() @ weight.double().T + bias.double()
    out = layer(x)
    # Two digits: each input moves by at most 1/256 of its block's step (max |x| / 127).
    steps = x.double().reshape(rows, -1, 32).abs().amax(-1, keepdim=True) / 127
    bound = (steps / 256).expand(rows, -1, 32).reshape(rows, cols) @ weight.double().abs().T
    assert ((out.double() - exact).abs() <= bound + 1e-5 * exact.abs() + 1e-6).all()
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 1e-3
    for path in PATHS:  # every path this CPU has gives the same bits
        layer.isa = path
        assert torch.equal(layer(x), out), path


# Every type has a tile body of its own on the AVX2 path: 4-bit (Q4_1, Q4_K), 5-bit (Q5_0,
# Q5_K), 6-bit (Q6_K) and 8-bit (Q8_0).
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K, Q.Q5_0, Q.Q5_K, Q.Q4_1, Q.Q4_K])
@pytest.mark.parametrize("rows", [6, 37])
def test_one_digit_paths_agree(qtype, rows):
    raw, _ = _any_raw(16, 256, qtype)
    layer = GGUFLinear(raw, qtype, digits=1)
    x = _activations(rows, 256)
    outputs = []
    for path in PATHS:
        layer.isa = path
        outputs.append(layer(x))
    assert all(torch.equal(out, outputs[0]) for out in outputs)


def test_the_kernel_runs_the_widest_path_the_features_allow():
    # The kernel lowers a path the CPU lacks (or whose tiles Linux withholds) to one it has:
    # here it must keep the one cpu_features names, or the bit checks above would compare a
    # path with itself.
    ops = extension.load()
    assert ops.gguf_path(gguf_kernel_isa()) == gguf_kernel_isa()
    assert ops.gguf_path(GGUF_PORTABLE) == GGUF_PORTABLE


def test_amx_tiles_are_the_path_only_with_amx_int8_and_vnni():
    vnni = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert gguf_kernel_isa(CpuFeatures.from_flags(vnni | {"amx_tile", "amx_int8"})) == GGUF_AMX
    assert gguf_kernel_isa(CpuFeatures.from_flags(vnni | {"amx_tile"})) == GGUF_VNNI
    amx = vnni | {"amx_tile", "amx_int8"}
    assert gguf_kernel_isa(CpuFeatures.from_flags(amx - {"avx512_vnni"})) == GGUF_AVX2
    assert "AMX-INT8" in describe_cpu(CpuFeatures.from_flags(amx))


@pytest.mark.parametrize(
    ("qtype", "bits_a_weight"), [(Q.Q4_0, 4.5), (Q.Q5_0, 5.5), (Q.Q8_0, 8.5), (Q.Q4_1, 5.5)]
)
def test_float_kinds_hold_the_files_bits(qtype, bits_a_weight):
    # m is -8 d (Q4_0), -16 d (Q5_0) or -128 d (Q8_0): the kernel derives it, so only q and
    # the file's fp16 d per 32 weights are held, the file's bits a weight. Q4_1 keeps its
    # own m, in fp32.
    raw, _ = _raw(16, 256, qtype)
    layer = GGUFLinear(raw, qtype)
    assert layer.scales.dtype == torch.float16
    assert (layer.mins.numel() == 0) == (qtype != Q.Q4_1)
    assert layer.weight_bytes() * 8 == bits_a_weight * 16 * 256


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_quant_weights_stay_near_the_file_size(qtype):
    raw, _ = _raw_k(64, 1024, qtype)
    layer = GGUFLinear(raw, qtype)
    assert layer.in_features == 1024 and layer.out_features == 64
    # The file's bytes plus an int8 scale and min per sub-block and two fp32 per 256 (the
    # file: 6-bit scales and fp16): at most 6% more.
    assert raw.nbytes <= layer.weight_bytes() <= 1.06 * raw.nbytes


def test_one_digit_is_coarser_than_two():
    raw, weight = _raw(16, 64, Q.Q4_1)
    x = _activations(6, 64)
    exact = x.double() @ weight.double().T
    errors = {}
    for digits in (1, 2):
        out = GGUFLinear(raw, Q.Q4_1, digits=digits)(x).double()
        errors[digits] = ((out - exact).norm() / exact.norm()).item()
    print(errors)
    assert errors[2] < 2e-4 and errors[1] > 100 * errors[2]


def test_leading_dimensions_and_fused_split():
    raw, _ = _raw(48, 64, Q.Q8_0)
    fused = GGUFMergedLinear(raw, Q.Q8_0, [32, 8, 8])
    x = _activations(6, 64).reshape(2, 3, 64)
    parts = fused.split(fused(x))
    assert [tuple(p.shape) for p in parts] == [(2, 3, 32), (2, 3, 8), (2, 3, 8)]
    # Each column is computed on its own, so fused equals apart bit for bit.
    for part, rows in zip(parts, (slice(0, 32), slice(32, 40), slice(40, 48)), strict=True):
        assert torch.equal(part, GGUFLinear(raw[rows], Q.Q8_0)(x))


def test_in_features_must_be_whole_blocks():
    raw, _ = _raw(8, 64, Q.Q4_0)
    layer = GGUFLinear(raw, Q.Q4_0)
    with pytest.raises(RuntimeError, match="packed weight has"):
        torch.ops.pagedllm.gguf_linear(
            torch.empty(1, 8), torch.randn(1, 96), layer.packed, layer.scales, layer.mins,
            4, 2, 2,
        )  # fmt: skip


def test_q5_0_beside_q8_0_repacks_exactly_as_q8_0():
    """A fused projection's Q5_0 part beside a Q8_0 one becomes Q8_0 blocks of the very same
    weights, so the two share one kernel call."""
    weight = np.random.default_rng(2).standard_normal((6, 128)).astype(np.float32)
    weight[3] *= 30
    raw = gguf.quants.quantize(weight, Q.Q5_0)
    assert kernel_type_of_run([Q.Q5_0, Q.Q8_0]) == Q.Q8_0
    assert kernel_type_of_run([Q.Q5_0, Q.Q5_0]) == Q.Q5_0
    assert kernel_type_of_run([Q.Q5_0, Q.Q4_0]) is None
    repacked = as_kernel_type(raw, Q.Q5_0, Q.Q8_0)
    assert repacked.shape == (6, 4 * 34)
    np.testing.assert_array_equal(
        gguf.quants.dequantize(repacked, Q.Q8_0), gguf.quants.dequantize(raw, Q.Q5_0)
    )
    with pytest.raises(ValueError, match="cannot be held as"):
        as_kernel_type(raw, Q.Q5_0, Q.Q4_0)


def test_unsupported_type_is_refused():
    raw = gguf.quants.quantize(np.zeros((4, 32), np.float32), Q.F16)
    with pytest.raises(ValueError, match="no quantized kernel"):
        unpack_blocks(raw.view(np.uint8), Q.F16)


# --------------------------------------------------------------------------- engine


def _qtype(gguf_name: str) -> Q:
    """Layer 0 all Q4_1; layer 1 mixes types inside q/k/v (Q5_0 beside Q8_0, then Q4_0) and
    has Q4_0, Q5_0, Q8_0 and F16 elsewhere; the tied embedding is Q8_0, as in the default
    model."""
    if gguf_name.startswith("token_embd"):
        return Q.Q8_0
    layer, part = gguf_name.split(".")[1:3]
    if layer == "0":
        return Q.Q4_1
    types = {"attn_q": Q.Q5_0, "attn_k": Q.Q8_0, "attn_v": Q.Q4_0, "ffn_down": Q.F16}
    types.update(ffn_gate=Q.Q5_0, ffn_up=Q.Q5_0)
    return types.get(part, Q.Q4_0 if part == "attn_output" else Q.Q8_0)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    model = tiny_model(
        "llama",
        vocab_size=320,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    path = tmp_path_factory.mktemp("gguf-quant") / "tiny.gguf"
    write_model_gguf(path, model, "llama", _qtype)
    return path


@pytest.fixture(scope="module")
def engines(tiny_gguf):
    common = dict(max_model_len=256, skip_tokenizer_init=True, disable_log_stats=True)
    return LLM(str(tiny_gguf), **common), LLM(str(tiny_gguf), quantization="gguf", **common)


def test_kernel_layers_replace_the_linear_layers_they_can(engines):
    model = model_runner(engines[1]).model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    kept = {n for n, m in model.named_modules() if isinstance(m, Linear)}
    assert set(layers) >= {
        "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate_up_proj", "lm_head",
    }  # fmt: skip
    # Only the F16 down projection stays fp32.
    assert kept == {"model.layers.1.mlp.down_proj"}
    assert isinstance(layers["model.layers.0.mlp.gate_up_proj"], GGUFMergedLinear)
    assert layers["model.layers.1.mlp.gate_up_proj"].ggml_type == Q.Q5_0
    # q/k/v of mixed types: one kernel layer per run of types that share one (q's Q5_0
    # held as Q8_0 beside k's Q8_0).
    qkv = model.get_submodule("model.layers.1.self_attn.qkv_proj")
    assert isinstance(qkv, GGUFConcatLinear)
    assert [p.ggml_type for p in qkv.parts] == [Q.Q8_0, Q.Q4_0]
    assert layers["lm_head"].ggml_type == Q.Q8_0
    # The tied embedding looks its rows up in the head's own blocks.
    embedding = model.model.embed_tokens
    assert isinstance(embedding, GGUFEmbedding)
    assert embedding.packed.data_ptr() == layers["lm_head"].packed.data_ptr()


def test_greedy_output_is_fp32s_up_to_ties(engines):
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 320, (int(n),), generator=generator).tolist()
        for n in torch.randint(4, 40, (NUM_PROMPTS,), generator=generator)
    ]
    fp32, quantized = (greedy_with_logprobs(llm, prompts, MAX_TOKENS) for llm in engines)
    ties, largest_logprob_error = compare_to_reference_engine(fp32, quantized, TIE_TOLERANCE)
    print(f"ties: {ties}; largest logprob difference: {largest_logprob_error:.2e}")
    assert largest_logprob_error < 1e-4


def test_eight_bit_activations_run_one_digit_near_the_fp32_logprobs(tiny_gguf, engines):
    # gguf_activation_bits=8: one int8 digit per activation (llama.cpp's precision), in every
    # kernel layer. The first token's logprob stays near fp32's, further than two digits'.
    one_digit = LLM(
        str(tiny_gguf),
        quantization="gguf",
        gguf_activation_bits=8,
        max_model_len=256,
        skip_tokenizer_init=True,
        disable_log_stats=True,
    )
    layers = [m for m in model_runner(one_digit).model.modules() if isinstance(m, GGUFLinear)]
    assert layers and all(layer.digits == 1 for layer in layers)
    two_digit_layers = model_runner(engines[1]).model.modules()
    assert all(m.digits == 2 for m in two_digit_layers if isinstance(m, GGUFLinear))
    prompts = [[5, 17, 99, 200, 31], [7, 8, 9]]
    fp32, two, one = (greedy_with_logprobs(llm, prompts, 4) for llm in (*engines, one_digit))
    two_errors, one_errors = [], []
    for want, got_two, got_one in zip(fp32, two, one, strict=True):
        token = want.token_ids[0]
        reference = want.logprobs[0][token].logprob
        two_errors.append(abs(got_two.logprobs[0][token].logprob - reference))
        one_errors.append(abs(got_one.logprobs[0][token].logprob - reference))
        assert len(got_one.token_ids) == 4
    assert max(two_errors) < max(one_errors) < 0.1


def test_gguf_activation_bits_are_checked():
    with pytest.raises(ValueError, match=r"gguf_activation_bits must be one of \[16, 8\]"):
        EngineArgs(quantization="gguf", gguf_activation_bits=4)
    with pytest.raises(ValueError, match="applies to quantization='gguf' only"):
        EngineArgs(gguf_activation_bits=8)


def test_gguf_quantization_needs_a_gguf_file(tiny_model_factory):
    directory = tiny_model_factory("LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        EngineArgs(model=str(directory), quantization="gguf")
    with pytest.raises(ValueError, match="needs dtype float32"):
        EngineArgs(quantization="gguf", dtype="bfloat16")


@pytest.mark.slow  # long: a compile
def test_compiled_decode_step_equals_eager(tiny_gguf, engines, report_ties):
    """The gguf kernel traces like the fp32 ones (`compile=True`): the same bits."""
    compiled = LLM(
        str(tiny_gguf),
        quantization="gguf",
        compile=True,
        max_model_len=256,
        skip_tokenizer_init=True,
        disable_log_stats=True,
    )
    assert model_runner(compiled).compiled_decode is not None
    prompts = [[5, 9, 31, 7], list(range(3, 40)), [11] * 17]
    want, got = (greedy_with_logprobs(llm, prompts, MAX_TOKENS) for llm in (engines[1], compiled))
    assert_bit_equal_to_reference(want, got, report_ties)


@pytest.mark.parametrize("qtype", KERNEL_TYPES + K_TYPES)
def test_embedding_rows_are_ggufs_dequantized_rows(qtype):
    # 21 rows: the last tile of 8 is part padding.
    raw, weight = _any_raw(21, 512, qtype)
    layer = GGUFLinear(raw, qtype)
    tables = dict(layer.named_buffers(remove_duplicate=False))
    tables.pop("bias", None)
    embedding = GGUFEmbedding(tables, qtype, 21, 512)
    ids = torch.tensor([[0, 20, 3], [7, 8, 3]])
    rows = embedding(ids)
    assert rows.shape == (2, 3, 512)
    assert torch.equal(rows, weight[ids])  # gguf's own formula, bit for bit


def test_embedding_refuses_ids_past_the_vocabulary():
    raw, _ = _any_raw(21, 256, Q.Q4_K)
    tables = dict(GGUFLinear(raw, Q.Q4_K).named_buffers(remove_duplicate=False))
    tables.pop("bias", None)
    embedding = GGUFEmbedding(tables, Q.Q4_K, 21, 256)
    with pytest.raises(IndexError, match="out of range"):
        embedding(torch.tensor([21]))  # a padding row of the last tile, not a token


@pytest.mark.parametrize("rows", [[16, 8, 8], [16, 5, 8]])
def test_parts_pack_like_their_stack(rows):
    # Parts of whole tiles go into their own tiles; otherwise they are stacked first.
    parts = [_raw_k(n, 256, Q.Q6_K, seed=i)[0] for i, n in enumerate(rows)]
    stacked = pack_gguf(np.concatenate(parts), Q.Q6_K)
    for name, tensor in pack_gguf(parts, Q.Q6_K).items():
        assert torch.equal(tensor, stacked[name]), name
