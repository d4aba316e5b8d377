"""The fp8 kernels (ops/csrc/fp8_dequant.cpp) on raw e4m3 bytes: every code, subnormals, both
zeros, the largest values and the NaNs decode to torch's values times the scale with one
rounding on either path (including scales the fast decode cannot carry 2^8 in); `fp8_linear`
gives the same bits on the AVX2 and AVX-512 paths, the same bits for a row whatever rows
share its call, and the reference product within fp32 rounding; and the path each CPU runs."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops import extension
from pagedllm.ops.cpu_features import FP8_AVX2, FP8_AVX512, CpuFeatures, fp8_kernel_isa

needs_kernels = pytest.mark.skipif(not extension.available(), reason="no AVX2 compiler here")
PATHS = [FP8_AVX2, FP8_AVX512]
NAN_MAGNITUDE = 0x7F
# A scale whose product with 2^8 overflows (the exact slow path), a subnormal product's, and
# ordinary ones.
SCALES = [1.0, 3.0e-3, 0.7, 2.0e38, 1.0e-36, -0.25]


def _bytes(rows: int, cols: int, seed: int, nans: bool = False) -> torch.Tensor:
    """Random codes without NaNs, then every code in order from the first (zeros,
    subnormals, 0x7E = 448, and with `nans` 0x7F and 0xFF, so only the first rows hold NaNs)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=generator)
    raw[(raw & NAN_MAGNITUDE) == NAN_MAGNITUDE] = 0x7E
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if not nans:
        codes[(codes & NAN_MAGNITUDE) == NAN_MAGNITUDE] = 0x7E
    flat = raw.view(-1)
    flat[: min(256, flat.numel())] = codes[: flat.numel()]
    return raw.view(torch.float8_e4m3fn)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits wherever a number came out, NaN in the same places (a NaN's sign and
    payload say which operand of an addition carried it, not what the math is)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("scale", SCALES)
def test_every_code_decodes_to_torchs_value_times_the_scale(isa, scale):
    # 19 columns: each row's first 16 through the vector decode, 3 through the tail.
    values = _bytes(14, 19, seed=0, nans=True)
    out = torch.empty(14, 19)
    extension.load().fp8_dequant(out, values, torch.full((14, 1), scale), 1, 19, isa)
    assert _same_bits(out, values.float() * scale)


@needs_kernels
@pytest.mark.parametrize(("blocks", "cols"), [((1, 213), 213), ((128, 128), 200)])
def test_both_paths_dequantize_to_the_same_bits(blocks, cols):
    values = _bytes(300, cols, seed=1, nans=True)
    scale_shape = (-(-300 // blocks[0]), -(-cols // blocks[1]))
    scales = torch.rand(scale_shape, generator=torch.Generator().manual_seed(2)) * 1e-2
    outs = []
    for isa in PATHS:
        out = torch.empty(300, cols)
        extension.load().fp8_dequant(out, values, scales, *blocks, isa)
        outs.append(out)
    assert _same_bits(outs[0], outs[1])


def _linear(x, values, scales, blocks, isa) -> torch.Tensor:
    out = torch.empty(x.shape[0], values.shape[0])
    extension.load().fp8_linear(out, x, values, scales, *blocks, isa)
    return out


# Per channel with a K tail (213 = 13 x 16 + 5), and 128 x 128 blocks cut short both ways.
LAYOUTS = [((1, 213), 213), ((128, 128), 200)]


@needs_kernels
@pytest.mark.parametrize(("blocks", "cols"), LAYOUTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 19])
def test_both_paths_multiply_to_the_same_bits(blocks, cols, rows):
    # 37 weight rows: groups of 2 and 4 leave some over; NaN codes take the slow decode.
    values = _bytes(37 if blocks[0] == 1 else 300, cols, seed=3, nans=True)
    scale_shape = (-(-values.shape[0] // blocks[0]), -(-cols // blocks[1]))
    scales = torch.rand(scale_shape, generator=torch.Generator().manual_seed(4)) * 1e-2
    scales.view(-1)[1] = 2.0e38  # one block through the slow decode without NaNs
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(5))
    avx2, avx512 = (_linear(x, values, scales, blocks, isa) for isa in PATHS)
    assert avx2.isnan().any() and not avx2.isnan().all()  # the NaN codes reach the output
    assert _same_bits(avx2, avx512)


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(isa):
    values = _bytes(64, 256, seed=6)
    scales = torch.rand(64, 1, generator=torch.Generator().manual_seed(7)) * 1e-2
    x = torch.randn(19, 256, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([_linear(x[i : i + 1], values, scales, (1, 256), isa) for i in range(19)])
    assert torch.equal(_bits(_linear(x, values, scales, (1, 256), isa)), _bits(alone))


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize(("blocks", "cols"), LAYOUTS)
def test_the_product_is_the_references_within_fp32_rounding(isa, blocks, cols):
    values = _bytes(300, cols, seed=9)
    scale_shape = (-(-300 // blocks[0]), -(-cols // blocks[1]))
    scales = torch.rand(scale_shape, generator=torch.Generator().manual_seed(10)) * 1e-2
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(11))
    expanded = scales.repeat_interleave(blocks[0], 0)[:300].repeat_interleave(blocks[1], 1)
    weight = values.float() * expanded[:, :cols]
    expected = x.double() @ weight.double().T
    got = _linear(x, values, scales, blocks, isa).double()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_path_is_avx512_only_where_the_cpu_has_f_bw_and_vl():
    full = CpuFeatures.from_flags({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"})
    assert fp8_kernel_isa(full) == FP8_AVX512
    for hidden in ("avx512f", "avx512bw", "avx512vl"):
        flags = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"} - {hidden}
        assert fp8_kernel_isa(CpuFeatures.from_flags(flags)) == FP8_AVX2
