"""bf16 linear layers on AVX512-BF16 dot products (ops/csrc/bf16_dot_linear.cpp): which rows
`fused.linear` sends there, which CPUs choose it, and an engine decoding on it (the
kernel's sums are checked beside the AMX kernel's in test_amx_linear.py). The engine runs
it where the CPU has AVX512-BF16, AMX machines included when the tiles are hidden from
the selection; the routing and the choice are checked on every CPU."""

from __future__ import annotations

import pytest
import torch
from model_utils import model_runner, small_engine
from test_amx_linear import assert_one_rounding_apart, needs_bf16_dot

from pagedllm.model.layers import amx_tiles
from pagedllm.model.layers.linear import Linear
from pagedllm.ops import extension, fused, kernel_selection
from pagedllm.ops.kernel_selection import KernelSelection

pytestmark = pytest.mark.skipif(not extension.available(), reason="no AVX2 compiler here")

DOT_KERNELS = KernelSelection("cpu", fused_ops=True, sampler_draw=True, bf16_dot_linear=True)


def test_few_bf16_rows_go_to_the_dot_kernel_and_more_to_onednn(monkeypatch):
    weight = torch.randn(64, 64).bfloat16()
    calls = []
    monkeypatch.setattr(fused, "bf16_dot_linear", lambda x, packed, bias: calls.append(x.shape[0]))
    monkeypatch.setattr(fused, "amx_linear", lambda x, packed, bias: calls.append(-2))
    monkeypatch.setattr(fused, "onednn_linear", lambda x, packed, bias: calls.append(-1))
    for rows in (1, fused.BF16_DOT_MAX_ROWS, fused.BF16_DOT_MAX_ROWS + 1):
        x = torch.randn(rows, 64).bfloat16()
        fused.linear(x, weight, None, DOT_KERNELS, packed=object(), packed_amx=object())
    assert calls == [1, fused.BF16_DOT_MAX_ROWS, -1]


@pytest.mark.parametrize(
    "amx, bf16, fast_dots, dot_kernel",
    [
        (True, True, True, False),  # the tiles win where they exist
        (False, True, True, True),  # AMD Zen 4/5
        (False, True, False, False),  # Intel without AMX: half-rate dot products
        (False, False, False, False),
    ],
)
def test_the_dot_kernel_is_chosen_where_dot_products_are_fast_and_there_are_no_tiles(
    monkeypatch, amx, bf16, fast_dots, dot_kernel
):
    monkeypatch.setattr(kernel_selection, "amx_tiles_granted", lambda: amx)
    monkeypatch.setattr(kernel_selection, "bf16_matmul_native", lambda: amx or fast_dots)
    monkeypatch.setattr(kernel_selection, "bf16_dot_granted", lambda: bf16)
    chosen = kernel_selection.select_kernels(
        "cpu", torch.bfloat16, "cpu", head_dim=64, cache_dtype=torch.bfloat16
    )
    assert chosen.bf16_dot_linear is dot_kernel
    assert chosen.bf16_amx_linear is amx
    fp32 = kernel_selection.select_kernels(
        "cpu", torch.float32, "cpu", head_dim=64, cache_dtype=torch.float32
    )
    assert not fp32.bf16_dot_linear
    assert ("dot products" in chosen.describe()) is dot_kernel


@needs_bf16_dot
def test_a_bf16_engine_without_amx_decodes_on_dot_products(tiny_model_factory, monkeypatch):
    monkeypatch.setattr(kernel_selection, "amx_tiles_granted", lambda: False)
    monkeypatch.setattr(kernel_selection, "bf16_matmul_native", lambda: True)
    directory = tiny_model_factory("LlamaForCausalLM")
    model = model_runner(small_engine(directory, dtype="bfloat16")).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    fitting = [m for m in linears if amx_tiles.fits(m.weight)]
    assert fitting and all(m.packed_amx_weight is not None for m in fitting)
    layer = fitting[0]
    assert layer.kernels.bf16_dot_linear and not layer.kernels.bf16_amx_linear
    calls = []
    kernel = fused.bf16_dot_linear
    monkeypatch.setattr(fused, "bf16_dot_linear", lambda *args: calls.append(1) or kernel(*args))
    x = torch.randn(8, layer.weight.shape[1]).bfloat16()
    assert_one_rounding_apart(layer(x), x, layer.weight, layer.bias)
    assert calls == [1]
