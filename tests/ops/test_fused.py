"""The fused CPU kernels against their torch references, and the sampler's plain draw."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops import extension, fused
from pagedllm.ops.cpu_features import cpu_features
from pagedllm.ops.kernel_selection import KernelSelection
from pagedllm.sample.sampler import Sampler, SamplingMetadata

# What select_kernels gives an fp32 model on an AVX2 CPU.
KERNELS = KernelSelection(attention="cpu", fused_ops=True, sampler_draw=True)

pytestmark = pytest.mark.skipif(not extension.available(), reason="no AVX2 compiler here")


def test_rms_norm_matches_reference():
    torch.manual_seed(0)
    x, weight = torch.randn(37, 100), torch.randn(100)
    out, residual = fused.rms_norm(x, weight, 1e-5, kernels=KERNELS)
    expected, _ = fused.rms_norm(x, weight, 1e-5)
    assert residual is None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_rms_norm_reads_a_strided_range_of_heads(num_tokens):
    # The query heads of a fused q/k/v output: [tokens, heads, head_dim], rows of a token
    # head_dim apart, tokens a whole q/k/v row apart; written back contiguous.
    torch.manual_seed(2)
    qkv, weight = torch.randn(num_tokens, 4 + 2 + 2, 16), torch.randn(16)
    q = qkv.split([4, 2, 2], dim=1)[0]
    out, _ = fused.rms_norm(q, weight, 1e-6, kernels=KERNELS)
    expected, _ = fused.rms_norm(q.contiguous().view(-1, 16), weight, 1e-6, kernels=KERNELS)
    assert out.shape == q.shape and out.is_contiguous()
    assert torch.equal(out.view(-1, 16), expected)
    torch.testing.assert_close(out, fused.rms_norm(q, weight, 1e-6)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5])
def test_gelu_tanh_and_mul_kernel_gives_the_eager_bits(rows):
    # The kernel a compiled graph calls, against the eager expression (fused's eager path).
    torch.manual_seed(3)
    x = torch.randn(rows, 2 * 37) * 4
    gate, up = x.chunk(2, dim=-1)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    out = torch.empty(rows, 37)
    extension.load().gelu_tanh_and_mul(out, x)
    assert torch.equal(out, expected) and torch.equal(fused.gelu_tanh_and_mul(x, KERNELS), expected)


def test_soft_cap_kernel_and_eager_path_give_the_out_of_place_bits_in_place():
    torch.manual_seed(4)
    logits = torch.randn(3, 1001) * 80
    expected = torch.tanh(logits / 30.0) * 30.0
    in_kernel = logits.clone()
    extension.load().soft_cap(in_kernel, 30.0)
    capped = fused.soft_cap(logits, 30.0, KERNELS)
    assert capped.data_ptr() == logits.data_ptr()
    assert torch.equal(capped, expected) and torch.equal(in_kernel, expected)


@pytest.mark.parametrize("shape", [(37, 100), (3, 4, 256)])
def test_a_weight_offset_gives_the_bits_of_the_shifted_weight(shape):
    # Gemma's norms: the kernel adds the one as it reads each weight, in fp32 as `1.0 + w`,
    # so the graph makes no scale tensor; the bits are those of the precomputed scale.
    torch.manual_seed(4)
    x, weight = torch.randn(*shape) * 3, torch.randn(shape[-1])
    shifted = 1.0 + weight
    out, _ = fused.rms_norm(x, weight, 1e-6, kernels=KERNELS, weight_offset=1.0)
    assert torch.equal(out, fused.rms_norm(x, shifted, 1e-6, kernels=KERNELS)[0])
    assert torch.equal(fused.rms_norm(x, weight, 1e-6, weight_offset=1.0)[0],
                       fused.rms_norm(x, shifted, 1e-6)[0])  # fmt: skip
    rows = x.reshape(-1, shape[-1])
    residual = torch.randn(rows.shape)
    want = fused.rms_norm(rows.clone(), shifted, 1e-6, residual.clone(), kernels=KERNELS)
    got = fused.rms_norm(rows.clone(), weight, 1e-6, residual.clone(), KERNELS, 1.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fused_add_rms_norm_updates_both_in_place():
    torch.manual_seed(1)
    x, residual, weight = torch.randn(20, 64), torch.randn(20, 64), torch.randn(64)
    expected_out, expected_residual = fused.rms_norm(x.clone(), weight, 1e-6, residual.clone())
    x_in, residual_in = x.clone(), residual.clone()
    out, new_residual = fused.rms_norm(x_in, weight, 1e-6, residual_in, kernels=KERNELS)
    assert out.data_ptr() == x_in.data_ptr() and new_residual.data_ptr() == residual_in.data_ptr()
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_residual, expected_residual)


@pytest.mark.parametrize("width", [8, 13, 1536])
def test_silu_and_mul_matches_reference(width):
    torch.manual_seed(2)
    x = torch.randn(9, 2 * width) * 6  # large |x|: exp's clamping must not show
    out = fused.silu_and_mul(x, kernels=KERNELS)
    torch.testing.assert_close(out, fused.silu_and_mul(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, fused.SKINNY_MAX_ROWS])
@pytest.mark.parametrize(
    ("in_features", "out_features"), [(576, 960), (13, 7), (40, 33), (1536, 129)]
)
def test_skinny_linear_matches_torch(rows, in_features, out_features):
    """Odd sizes exercise the kernel's tails: reductions not a multiple of its 16-wide step
    (13, 40), row counts that leave passes of 2 and 1 input rows after those of 4 (3, 7),
    and a weight split unevenly over the threads."""
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    bias = torch.randn(out_features)
    out = fused.linear(x, weight, bias, kernels=KERNELS)
    # Only the summation order differs: sums of ~1,500 unit-sized products (|y| ~ 40)
    # differ by a few 1e-5 between orders.
    expected = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize(("in_features", "out_features"), [(13, 7), (1536, 129)])
def test_skinny_linear_on_a_16_bit_weight_sums_the_fp32_weights_products(
    dtype, rows, in_features, out_features
):
    """A 16-bit weight is converted in registers (fp16, bf16: every value an fp32 one) and
    multiplied in the fp32 weight's order: the same sums bit for bit, tails included."""
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, in_features), torch.randn(out_features, in_features).to(dtype)
    out, expected = torch.empty(rows, out_features), torch.empty(rows, out_features)
    extension.load().skinny_linear(out, x, weight)
    extension.load().skinny_linear(expected, x, weight.float())
    assert torch.equal(out, expected)
    torch.testing.assert_close(out, x @ weight.float().T, rtol=1e-5, atol=1e-4)


def test_skinny_linear_reads_strided_rows_and_leaves_larger_batches_to_torch(monkeypatch):
    torch.manual_seed(5)
    weight = torch.randn(64, 40)
    x = torch.randn(4, 80)[:, :40]  # rows 80 apart
    torch.testing.assert_close(
        fused.linear(x, weight, kernels=KERNELS), torch.nn.functional.linear(x, weight)
    )
    calls = []
    monkeypatch.setattr(fused, "load", lambda: calls.append(1))
    fused.linear(torch.randn(fused.SKINNY_MAX_ROWS + 1, 40), weight, kernels=KERNELS)
    assert calls == []


def test_rotary_rotates_strided_views_in_place():
    torch.manual_seed(3)
    tokens, heads, kv_heads, head_dim, max_pos = 11, 6, 2, 64, 100
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.randn(max_pos, head_dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions = torch.randint(0, max_pos, (tokens,))
    expected_q, expected_k = fused.rotary_embedding(positions, q.clone(), k.clone(), cos, sin)
    out_q, out_k = fused.rotary_embedding(positions, q, k, cos, sin, kernels=KERNELS)
    assert out_q.data_ptr() == qkv.data_ptr()  # rotated where it lies
    torch.testing.assert_close(out_q, expected_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_k, expected_k, rtol=1e-5, atol=1e-6)


# ---- bf16: the element-wise kernels round where the eager bf16 ops round -----------------


def bf16_mismatches(out: torch.Tensor, expected: torch.Tensor) -> float:
    """The share of elements whose bf16 bits differ from the reference's."""
    assert out.dtype == expected.dtype == torch.bfloat16
    return (out.view(torch.int16) != expected.view(torch.int16)).float().mean().item()


@pytest.mark.parametrize("width", [64, 67, 576])
def test_bf16_rms_norm_gives_the_reference_bits(width):
    """67 runs the scalar tail; the normalized row is rounded before the weight multiplies
    it, as Transformers' Llama norm does, so the bits agree (the fp32 sum of squares may
    round the other way only on a tie)."""
    torch.manual_seed(width)
    x, weight = torch.randn(33, width).bfloat16(), torch.randn(width).bfloat16()
    residual = torch.randn(33, width).bfloat16()
    out, _ = fused.rms_norm(x, weight, 1e-5, kernels=KERNELS)
    assert bf16_mismatches(out, fused.rms_norm(x, weight, 1e-5)[0]) < 1e-3
    expected_out, expected_residual = fused.rms_norm(x.clone(), weight, 1e-5, residual.clone())
    x_in, residual_in = x.clone(), residual.clone()
    out, new_residual = fused.rms_norm(x_in, weight, 1e-5, residual_in, kernels=KERNELS)
    assert out.data_ptr() == x_in.data_ptr() and new_residual.data_ptr() == residual_in.data_ptr()
    assert torch.equal(new_residual, expected_residual)  # one rounded add: exact
    assert bf16_mismatches(out, expected_out) < 1e-3


@pytest.mark.parametrize("width", [8, 13, 1536])
def test_bf16_silu_and_mul_gives_the_reference_bits(width):
    torch.manual_seed(width)
    x = (torch.randn(9, 2 * width) * 6).bfloat16()
    out = fused.silu_and_mul(x, kernels=KERNELS)
    expected = fused.silu_and_mul(x)
    # The kernel's exp differs from libm's by an ulp or so of fp32: a product that lands
    # next to a rounding boundary of bf16 may round the other way, by one bf16 ulp.
    assert bf16_mismatches(out, expected) < 0.01
    torch.testing.assert_close(out, expected, rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("head_dim", [12, 64])
def test_bf16_rotary_gives_the_reference_bits(head_dim):
    """cos and sin rounded to bf16 first and every product rounded on its own, as the eager
    q * cos + rotate_half(q) * sin in bf16."""
    torch.manual_seed(head_dim)
    tokens, max_pos = 19, 100
    angles = torch.randn(max_pos, head_dim // 2) * 3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions = torch.randint(0, max_pos, (tokens,))
    q = torch.randn(tokens, 9, head_dim).bfloat16()
    k = torch.randn(tokens, 3, head_dim).bfloat16()
    expected_q, expected_k = fused.rotary_embedding(positions, q.clone(), k.clone(), cos, sin)
    out_q, out_k = fused.rotary_embedding(positions, q, k, cos, sin, kernels=KERNELS)
    assert out_q.data_ptr() == q.data_ptr()
    assert bf16_mismatches(out_q, expected_q) == 0 and bf16_mismatches(out_k, expected_k) == 0


@pytest.mark.parametrize("width", [8, 16])
def test_bf16_rounding_matches_torch_on_ties_nan_and_infinities(width):
    """The kernels' fp32 -> bf16 rounding (to nearest, ties to even, NaN kept), seen through
    the residual add, against torch's bf16 add: exact ties of both parities, overflow to
    infinity, NaN and infinities, and sums in the subnormal range. Rows of 16 take the
    16-lane pass where the CPU has AVX-512."""
    half_ulp_at_one = 2.0**-8
    pairs = [
        (1.0, half_ulp_at_one),  # tie, even below: stays 1
        (1.0 + 2.0**-7, half_ulp_at_one),  # tie, odd below: rounds up
        (-1.0 - 2.0**-7, -half_ulp_at_one),
        (3.3e38, 3.3e38),  # overflow
        (float("nan"), 1.0),
        (float("inf"), -1.0),
        (-float("inf"), 5.0),
        (1e-39, 2e-39),  # subnormal
        (-0.0, 0.0),
    ]
    pairs += [(float(a), float(b)) for a, b in torch.randn(55, 2) * 100]
    residual = torch.tensor([a for a, _ in pairs]).bfloat16().view(-1, width)
    x = torch.tensor([b for _, b in pairs]).bfloat16().view(-1, width)
    expected = x + residual
    weight = torch.ones(width).bfloat16()
    _, got = fused.rms_norm(x.clone(), weight, 1e-5, residual.clone(), KERNELS)
    same = (got.view(torch.int16) == expected.view(torch.int16)) | (got.isnan() & expected.isnan())
    assert bool(same.all())


def test_rotary_refuses_positions_outside_the_cache():
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    cos = sin = torch.ones(4, 16)
    with pytest.raises(RuntimeError, match="outside"):
        fused.rotary_embedding(torch.tensor([4]), q, k, cos, sin, kernels=KERNELS)


def test_sample_plain_equals_the_reference_draw():
    """Same uniforms, same token, except where a uniform falls within rounding of a CDF
    step (none of 2,000 draws here)."""
    torch.manual_seed(4)
    logits = torch.randn(2000, 1000) * 3
    inv_temperature = torch.rand(2000) + 0.5
    uniforms = torch.rand(2000)
    kernel = fused.sample_plain(logits, inv_temperature, uniforms, kernels=KERNELS)
    reference = fused.sample_plain(logits, inv_temperature, uniforms)
    assert (kernel != reference).sum() == 0


def test_sample_plain_never_draws_masked_tokens():
    logits = torch.full((64, 300), float("-inf"))
    logits[:, 7], logits[:, 299] = 0.0, -50.0
    uniforms = torch.linspace(0, 0.999999, 64)
    uniforms[-1] = 1.0 - 2**-24  # the largest uniform torch.rand can return
    tokens = fused.sample_plain(logits, torch.ones(64), uniforms, kernels=KERNELS)
    assert set(tokens.tolist()) <= {7, 299}


def _metadata(rows: int, temperature: float) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((rows,), temperature),
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
        all_greedy=False,
        all_random=True,
    )


def test_sampler_with_kernels_draws_the_softmax_distribution():
    torch.manual_seed(5)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 40_000
    logits = (probs.log() * 0.5).expand(rows, 4).contiguous()  # temperature 0.5 undoes * 0.5
    tokens = Sampler(KERNELS)(logits, _metadata(rows, 0.5), compute_logprobs=False)
    frequencies = torch.bincount(tokens.token_ids, minlength=4).float() / rows
    torch.testing.assert_close(frequencies, probs, atol=0.01, rtol=0)


def _greedy_rows() -> torch.Tensor:
    """Rows where torch.argmax's rule shows: ties (the first wins), NaNs (the first NaN
    wins, wherever the maximum is), -inf, signed zeros, the maximum in the vector body and in
    the tail (13 columns: one vector of 8 and a tail of 5)."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 13, generator=generator)
    rows[1, [3, 9]] = 50.0  # a tie in the body and the tail
    rows[2, 11] = 60.0  # the maximum in the tail
    rows[3, [2, 7]] = float("nan")
    rows[4, 12] = float("nan")  # a NaN in the tail, the maximum before it
    rows[4, 0] = 70.0
    rows[5] = float("-inf")
    rows[6] = float("-inf")
    rows[6, 10] = -1e30
    rows[7] = 0.0
    rows[7, 0] = -0.0
    rows[8, 4], rows[8, 6] = float("inf"), float("inf")
    rows[9] = -rows[9].abs() - 1.0
    rows[9, 12] = -0.5
    return rows


@pytest.mark.parametrize("columns", [13, 1, 262144])
def test_greedy_pick_is_torch_argmax(columns):
    if columns == 13:
        logits = _greedy_rows()
    else:
        logits = torch.randn(5, columns, generator=torch.Generator().manual_seed(columns))
        logits[1, -1] = 100.0
        logits[2, columns // 2] = float("nan")
    expected = logits.argmax(dim=-1)
    assert torch.equal(fused.greedy_pick(logits, KERNELS), expected)
    # A strided view of wider rows: the kernel steps by the row stride.
    wide = torch.full((logits.shape[0], columns + 3), 1e9)
    wide[:, :columns] = logits
    assert torch.equal(fused.greedy_pick(wide[:, :columns], KERNELS), expected)


needs_avx512 = pytest.mark.skipif(
    not (extension.available() and cpu_features().avx512f), reason="the CPU has no AVX-512"
)


def restored(name: str):
    """Yields the extension's `set_<name>` for a test and restores the setting after it."""
    ops = extension.load()
    before = getattr(ops, f"get_{name}")()
    yield getattr(ops, f"set_{name}")
    getattr(ops, f"set_{name}")(before)


@pytest.fixture
def lanes():
    """Sets the element-wise kernels' lane count for a test, and restores it."""
    yield from restored("vector_lanes")


def test_the_extension_takes_16_lanes_exactly_where_the_cpu_has_avx512(lanes):
    assert extension.load().get_vector_lanes() == (16 if cpu_features().avx512f else 8)
    with pytest.raises(RuntimeError, match="lanes must be 8 or 16"):
        lanes(4)
    if not cpu_features().avx512f:
        with pytest.raises(RuntimeError, match="no AVX-512"):
            lanes(16)


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [16, 40, 67, 576])
def test_16_lanes_give_the_8_lane_bits(lanes, dtype, width):
    """The AVX-512 passes (SiLU·up, RMSNorm's scaling, the residual add, RoPE with `width`
    pairs) do each element's operations in the 8-lane order: the same bits, tails included."""
    torch.manual_seed(width)
    x = (torch.randn(21, width) * 3).to(dtype)
    gate_up = (torch.randn(21, 2 * width) * 6).to(dtype)
    weight, residual = torch.randn(width).to(dtype), torch.randn(21, width).to(dtype)
    qk = (torch.randn(21, 5, 2 * width) * 3).to(dtype)
    positions = torch.randint(0, 50, (21,))
    angles = torch.randn(50, width) * 3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    results = {}
    for count in (8, 16):
        lanes(count)
        normed = [fused.rms_norm(x, weight, 1e-5, kernels=KERNELS)[0]]
        for offset in (0.0, 1.0):
            x_in, residual_in = x.clone(), residual.clone()
            extension.load().fused_add_rms_norm(x_in, residual_in, weight, 1e-5, offset)
            normed += [x_in, residual_in]
        rotated = fused.rotary_embedding(
            positions, qk[:, :4].clone(), qk[:, 4:].clone(), cos, sin, kernels=KERNELS
        )
        results[count] = [fused.silu_and_mul(gate_up, kernels=KERNELS), *normed, *rotated]
    for eight, sixteen in zip(results[8], results[16], strict=True):
        assert torch.equal(
            eight.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            sixteen.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        )


@pytest.fixture
def native_round():
    """Sets whether bf16 results are rounded by the CPU's own conversion, and restores it."""
    yield from restored("native_bf16_round")


def test_bf16_rounding_is_the_cpus_own_exactly_where_it_has_avx512_bf16(native_round):
    assert extension.load().get_native_bf16_round() == cpu_features().avx512_bf16
    if not cpu_features().avx512_bf16:
        with pytest.raises(RuntimeError, match="no AVX512-BF16"):
            native_round(True)


@pytest.mark.skipif(
    not (extension.available() and cpu_features().avx512_bf16 and cpu_features().avx512f),
    reason="the CPU has no AVX512-BF16",
)
@pytest.mark.parametrize("width", [16, 67, 576])
def test_the_cpus_bf16_rounding_gives_the_integer_roundings_bits(lanes, native_round, width):
    """SiLU·up, RMSNorm and RoPE on 16 lanes round bf16 results with vcvtneps2bf16 where the
    CPU has it: to nearest, ties to even, the same bits as the integer rounding, ties, values
    past bf16's largest and subnormal products (which the instruction would flush) included."""
    lanes(16)
    torch.manual_seed(width)
    gate_up = (torch.randn(33, 2 * width) * 6).bfloat16()
    # Products exactly halfway between two bf16 values, past the largest, and subnormal.
    gate_up[0, width:] = 1.0 + 2.0**-8
    gate_up[1, width:] = 3.0e38
    gate_up[2, width:] = 1e-39
    x, weight = (torch.randn(33, width) * 3).bfloat16(), torch.randn(width).bfloat16()
    qk = (torch.randn(33, 5, 2 * width) * 3).bfloat16()
    positions = torch.randint(0, 50, (33,))
    angles = torch.randn(50, width) * 3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    results = {}
    for native in (False, True):
        native_round(native)
        results[native] = [
            fused.silu_and_mul(gate_up, kernels=KERNELS),
            fused.rms_norm(x, weight, 1e-5, kernels=KERNELS)[0],
            *fused.rotary_embedding(
                positions, qk[:, :4].clone(), qk[:, 4:].clone(), cos, sin, kernels=KERNELS
            ),
        ]
    for integer, native in zip(results[False], results[True], strict=True):
        assert torch.equal(integer.view(torch.int16), native.view(torch.int16))
    silu = results[True][0]
    assert silu[1].isinf().any() and ((silu[2] != 0) & (silu[2].abs() < 1.18e-38)).any()
