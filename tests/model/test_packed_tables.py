"""A packed checkpoint's kernel tables (pagedllm/model/layers/packed_tables.py): the compact
form (fp16 / bf16 scales, uint8 zero points) gives the layer output of fp32 scale and min
tables bit for bit on every kernel path this CPU runs, and the C++ packing of q is the torch
reference's bytes."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.layers.gguf_linear import _NO_MINS, pack_q, per_tile
from pagedllm.model.layers.gptq_linear import GPTQLinear
from pagedllm.model.layers.packed_tables import pack_q_tiles
from pagedllm.model.quantization.gptq_format import UnpackedGPTQ
from pagedllm.ops.extension import load

IN_FEATURES = 256
# 5 tiles: the VNNI path's pairs of tiles and a single one; 11 rows: passes of 8, 2 and 1.
OUT_FEATURES, ROWS = 40, 11
ISAS = {"portable": 0, "avx2": 1, "vnni": 2}  # each lowered to what this CPU has


def _weights(
    bits: int, group_size: int, scale_type: torch.dtype, symmetric: bool, seed: int = 0
) -> UnpackedGPTQ:
    generator = torch.Generator().manual_seed(seed)
    groups = IN_FEATURES // group_size
    q = torch.randint(0, 2**bits, (OUT_FEATURES, IN_FEATURES), generator=generator)
    # Scales down to 2^-24: fp16 holds a bf16 scale of that size only rounded.
    scales = torch.rand(OUT_FEATURES, groups, generator=generator) * 2.0 ** torch.randint(
        -24, 2, (OUT_FEATURES, groups), generator=generator
    )
    if symmetric:
        zeros = torch.full((OUT_FEATURES, groups), 2.0 ** (bits - 1))
    else:
        zeros = torch.randint(0, 2**bits, (OUT_FEATURES, groups), generator=generator).float()
    scales = scales.to(scale_type).float()
    return UnpackedGPTQ(q.to(torch.uint8), scales, zeros, None, group_size, bits)


def _fp32_tables_output(layer: GPTQLinear, weights: UnpackedGPTQ, x: torch.Tensor) -> torch.Tensor:
    """The layer's product with the fp32 d and m tables it kept before the compact form."""
    mins = _NO_MINS if weights.symmetric else per_tile(-weights.scales * weights.zeros)
    out = torch.empty(x.shape[0], OUT_FEATURES)
    load().gguf_linear(
        out, x, layer.packed, per_tile(weights.scales), mins, weights.bits, layer.digits,
        layer.isa, layer.scale_shift,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("isa", ISAS.values(), ids=ISAS.keys())
@pytest.mark.parametrize(
    ("bits", "group_size", "scale_type", "symmetric", "held_scale", "held_min"),
    [
        (4, 32, torch.float16, False, torch.float16, torch.uint8),  # GPTQ / AWQ asymmetric
        (4, 32, torch.float16, True, torch.float16, None),  # GPTQ symmetric
        (4, 32, torch.bfloat16, False, torch.bfloat16, torch.uint8),  # compressed-tensors
        (4, 128, torch.float16, False, torch.float16, torch.uint8),
        (8, IN_FEATURES, torch.bfloat16, False, torch.bfloat16, torch.uint8),  # W8A16
        (4, 32, torch.float32, False, torch.float32, torch.uint8),  # no narrower type is exact
    ],
)
def test_compact_tables_give_the_fp32_tables_output_exactly(
    bits, group_size, scale_type, symmetric, held_scale, held_min, isa
):
    weights = _weights(bits, group_size, scale_type, symmetric)
    layer = GPTQLinear(weights)
    layer.isa = isa
    assert layer.scales.dtype == held_scale
    assert (layer.mins.numel() == 0) if held_min is None else (layer.mins.dtype == held_min)
    x = torch.randn(ROWS, IN_FEATURES, generator=torch.Generator().manual_seed(1))
    for rows in (ROWS, 1):
        ours, theirs = layer(x[:rows]), _fp32_tables_output(layer, weights, x[:rows])
        assert torch.equal(ours, theirs)
    # ...and that product is the dequantized weights' (a wrong table would be far off), up
    # to the activations' two int8 digits (~15 bits).
    expected = x[:1] @ weights.dequantize().T
    assert (ours - expected).abs().max() < 1e-4 * expected.abs().max()


def test_every_kernel_path_gives_the_same_bits_on_compact_tables():
    weights = _weights(4, 32, torch.bfloat16, False, seed=2)
    x = torch.randn(ROWS, IN_FEATURES, generator=torch.Generator().manual_seed(3))
    layer = GPTQLinear(weights)
    outputs = []
    for isa in ISAS.values():
        layer.isa = isa
        outputs.append(layer(x))
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])


def test_zero_points_beyond_uint8_keep_fp32_mins():
    weights = _weights(4, 32, torch.float16, False, seed=4)
    weights.zeros[0, 0] = 300.0  # not a stored zero point of any format served
    layer = GPTQLinear(weights)
    assert layer.mins.dtype == torch.float32
    x = torch.randn(3, IN_FEATURES, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(layer(x), x @ weights.dequantize().T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed-view"])
def test_packing_is_the_reference_bytes(bits, transposed):
    generator = torch.Generator().manual_seed(bits)
    rows = 20  # two whole tiles and a padded one
    q = torch.randint(0, 2**bits, (rows, 96), generator=generator).to(torch.uint8)
    view = q.T.contiguous().T if transposed else q
    assert view.is_contiguous() != transposed
    assert torch.equal(pack_q_tiles(view, bits), pack_q(q, bits))
