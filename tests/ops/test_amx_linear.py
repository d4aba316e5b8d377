"""bf16 linear layers on AMX tiles (ops/csrc/amx_linear.cpp) and, over the same tile-layout
copy, on AVX512-BF16 dot products (ops/csrc/bf16_dot_linear.cpp): the tile layout, the fp32
sums rounded once, which rows `fused.linear` sends there, and which layers get a tile copy.
Each kernel's arithmetic runs where the CPU has its instructions; the layout, the routing and
the choice of layers are checked on every CPU."""

from __future__ import annotations

import pytest
import torch
from model_utils import model_runner, small_engine

from pagedllm.model.layers import amx_tiles
from pagedllm.model.layers.linear import Linear
from pagedllm.ops import extension, fused
from pagedllm.ops.cpu_features import cpu_features
from pagedllm.ops.kernel_selection import KernelSelection, amx_tiles_granted

pytestmark = pytest.mark.skipif(not extension.available(), reason="no AVX2 compiler here")

AMX_KERNELS = KernelSelection("cpu", fused_ops=True, sampler_draw=True, bf16_amx_linear=True)
needs_amx = pytest.mark.skipif(
    not (extension.available() and amx_tiles_granted()), reason="the CPU has no AMX-BF16"
)


def assert_one_rounding_apart(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """out is x W^T (+ b) summed in fp32 in some order and rounded to bf16 once: within one
    bf16 step of the fp32 reference, plus what reordering fp32 sums may change (a few fp32
    steps of the sum of |products|, which matters where the sum cancels)."""
    reference = torch.nn.functional.linear(
        x.float(), weight.float(), None if bias is None else bias.float()
    )
    magnitude = torch.nn.functional.linear(x.float().abs(), weight.float().abs())
    exponent = torch.frexp(reference.abs().clamp_min(torch.finfo(torch.float32).tiny)).exponent
    bf16_step = torch.ldexp(torch.ones_like(reference), exponent - 8)
    error = (out.float() - reference).abs()
    assert (error <= bf16_step + 2.0**-16 * magnitude).all(), error.max()
    # Nearly always the very bf16 number the reference rounds to.
    assert (out == reference.bfloat16()).float().mean() > 0.99


def test_the_tile_layout_holds_column_pairs_of_32_column_blocks():
    weight = torch.arange(64 * 96, dtype=torch.float32).reshape(64, 96).bfloat16()
    packed = amx_tiles.pack(weight)
    assert packed.shape == (2, 3, 16, 32, 2)
    # Block j, k-step s, tile row r, column c, pair p holds W[32 j + c][32 s + 2 r + p].
    for j, s, r, c, p in [(0, 0, 0, 0, 1), (1, 2, 15, 31, 0), (1, 0, 7, 3, 1), (0, 2, 3, 17, 0)]:
        assert packed[j, s, r, c, p] == weight[32 * j + c, 32 * s + 2 * r + p]


@pytest.mark.parametrize(
    "shape, fits",
    [((96, 64), True), ((960, 576), True), ((100, 64), False), ((96, 48), False)],
)
def test_the_kernel_takes_sizes_in_multiples_of_32(shape, fits):
    assert amx_tiles.fits(torch.zeros(shape, dtype=torch.bfloat16)) is fits
    assert not amx_tiles.fits(torch.zeros(shape))  # fp32 stays on oneDNN


def test_few_bf16_rows_go_to_the_tiles_and_more_to_onednn(monkeypatch):
    weight = torch.randn(64, 64).bfloat16()
    calls = []
    monkeypatch.setattr(fused, "amx_linear", lambda x, packed, bias: calls.append(x.shape[0]))
    monkeypatch.setattr(fused, "onednn_linear", lambda x, packed, bias: calls.append(-1))
    for rows in (1, fused.AMX_MAX_ROWS, fused.AMX_MAX_ROWS + 1):
        x = torch.randn(rows, 64).bfloat16()
        fused.linear(x, weight, None, AMX_KERNELS, packed=object(), packed_amx=object())
    assert calls == [1, fused.AMX_MAX_ROWS, -1]


def test_a_cpu_without_amx_or_bf16_dots_gets_no_tile_copies(tiny_model_factory, monkeypatch):
    monkeypatch.setattr("pagedllm.ops.kernel_selection.amx_tiles_granted", lambda: False)
    monkeypatch.setattr("pagedllm.ops.kernel_selection.bf16_dot_granted", lambda: False)
    directory = tiny_model_factory("LlamaForCausalLM")
    model = model_runner(small_engine(directory, dtype="bfloat16")).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_amx_weight is None for m in linears)
    assert not linears[0].kernels.bf16_amx_linear


needs_bf16_dot = pytest.mark.skipif(
    not (extension.available() and cpu_features().avx512_bf16 and cpu_features().avx512bw),
    reason="the CPU has no AVX512-BF16",
)
# The kernels on the tile-layout copy: AMX tiles, and AVX512-BF16 dot products
# (ops/csrc/bf16_dot_linear.cpp, which AMX machines run too when asked).
TILE_KERNELS = [
    pytest.param("amx_linear", marks=needs_amx, id="amx"),
    pytest.param("bf16_dot_linear", marks=needs_bf16_dot, id="bf16_dots"),
]


@pytest.mark.parametrize("kernel", TILE_KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 16, 17, 32, 33, 64, 100, 1000])  # 1000: panels
@pytest.mark.parametrize("with_bias", [False, True])
def test_sums_are_the_fp32_sums_rounded_once(kernel, rows, with_bias):
    torch.manual_seed(rows)
    weight, x = torch.randn(960, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
    bias = torch.randn(960).bfloat16() if with_bias else None
    out = getattr(fused, kernel)(x, amx_tiles.pack(weight), bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 960)
    assert_one_rounding_apart(out, x, weight, bias)


@pytest.mark.parametrize("kernel", TILE_KERNELS)
def test_rows_are_read_in_place_from_a_strided_input(kernel):
    torch.manual_seed(0)
    weight, wide = torch.randn(64, 96).bfloat16(), torch.randn(20, 160).bfloat16()
    x = wide[:, 32:128]  # rows 160 apart
    out = torch.empty(20, 64, dtype=torch.bfloat16)
    getattr(fused.load(), kernel)(out, x, amx_tiles.pack(weight), None)
    expected = getattr(fused, kernel)(x.contiguous(), amx_tiles.pack(weight))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("kernel", TILE_KERNELS)
def test_mismatched_operands_are_refused_by_name(kernel):
    run, weight = getattr(fused.load(), kernel), torch.randn(64, 96).bfloat16()
    out, x = torch.empty(2, 64, dtype=torch.bfloat16), torch.randn(2, 96).bfloat16()
    with pytest.raises(RuntimeError, match="packed by amx_pack_weight"):
        run(out, x, weight[:32].contiguous(), None)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        run(out, torch.randn(2, 80).bfloat16(), amx_tiles.pack(weight), None)
    with pytest.raises(RuntimeError, match="bf16"):
        run(out, torch.randn(2, 96), amx_tiles.pack(weight), None)
    with pytest.raises(RuntimeError, match="bias"):
        run(out, x, amx_tiles.pack(weight), torch.zeros(63))


@needs_amx
def test_a_bf16_engine_decodes_on_the_tiles(tiny_model_factory):
    directory = tiny_model_factory("LlamaForCausalLM")
    model = model_runner(small_engine(directory, dtype="bfloat16")).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    fitting = [m for m in linears if amx_tiles.fits(m.weight)]
    assert fitting and all(m.packed_amx_weight is not None for m in fitting)
    assert all(m.packed_amx_weight is None for m in linears if m not in fitting)
    layer = fitting[0]
    x = torch.randn(8, layer.weight.shape[1]).bfloat16()
    assert_one_rounding_apart(layer(x), x, layer.weight, layer.bias)
