"""Linear weights prepacked for oneDNN: every fp32 linear layer and a tied head get one, the
packed path equals torch's linear, the fewest rows keep the skinny kernel, and
PAGEDLLM_ONEDNN=0 turns packing off."""

from __future__ import annotations

import pytest
import torch
from model_utils import model_runner, small_engine

from pagedllm.model.layers import onednn
from pagedllm.model.layers.linear import Linear
from pagedllm.ops import fused
from pagedllm.ops.kernel_selection import KernelSelection

# What select_kernels gives an fp32 model on an AVX2 CPU.
KERNELS = KernelSelection(attention="cpu", fused_ops=True, sampler_draw=True)

pytestmark = pytest.mark.skipif(not onednn.available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [fused.PACKED_MIN_ROWS, 37, 300])
def test_packed_linear_equals_torch(rows):
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(129, 200), torch.randn(129), torch.randn(rows, 200)
    out = fused.linear(x, weight, bias, kernels=KERNELS, packed=onednn.pack(weight))
    expected = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


def test_fewest_rows_keep_the_skinny_kernel(monkeypatch):
    weight = torch.randn(64, 40)
    packed = onednn.pack(weight)
    ops = fused.load()
    calls = []
    monkeypatch.setattr(fused, "load", lambda: calls.append(1) or ops)  # the skinny path's
    for rows in (fused.PACKED_MIN_ROWS - 1, fused.PACKED_MIN_ROWS):
        x = torch.randn(rows, 40)
        out = fused.linear(x, weight, kernels=KERNELS, packed=packed)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight))
    assert calls == [1]  # only the smaller batch went to the skinny kernel


def test_every_fp32_linear_and_the_tied_head_are_packed(tiny_model_factory, monkeypatch):
    directory = tiny_model_factory("LlamaForCausalLM:tied-bias")
    model = model_runner(small_engine(directory)).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None for m in linears)
    # The tied head is a Linear on the embedding's own parameter, packed like the others.
    assert model.lm_head in linears and model.lm_head.weight is model.model.embed_tokens.weight
    hidden = torch.randn(5, model.config.hidden_size)
    torch.testing.assert_close(
        model.compute_logits(hidden), torch.nn.functional.linear(hidden, model.lm_head.weight)
    )
    monkeypatch.setenv("PAGEDLLM_ONEDNN", "0")
    model = model_runner(small_engine(directory)).model
    assert all(m.packed_weight is None for m in model.modules() if isinstance(m, Linear))


def test_packing_is_skipped_when_the_copies_would_not_fit(tiny_model_factory, monkeypatch):
    # No memory to spare: a large model keeps only its plain weights instead of failing.
    monkeypatch.setattr(onednn, "MAX_SHARE_OF_AVAILABLE_MEMORY", 0.0)
    directory = tiny_model_factory("LlamaForCausalLM")
    model = model_runner(small_engine(directory)).model
    assert all(m.packed_weight is None for m in model.modules() if isinstance(m, Linear))
