"""Linear weights prepacked for oneDNN: every fp32 linear layer and a tied head get one, the
packed path equals torch's linear, the fewest rows keep the skinny kernel, and
PAGEDLLM_ONEDNN=0 turns packing off."""

from __future__ import annotations

import pytest
import torch
from model_utils import model_runner, small_engine

from pagedllm import SamplingParams
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


# ---- bf16 layers: a bf16 packed weight, and an fp32 copy for many rows where it pays ----

BF16_KERNELS = KernelSelection("cpu", fused_ops=True, sampler_draw=True, bf16_matmul_in_fp32=True)


def bf16_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """bf16 products summed in fp32, rounded once: what either packed path computes."""
    return torch.nn.functional.linear(x.float(), weight.float(), bias.float()).bfloat16()


@pytest.mark.parametrize("rows", [1, 3, fused.BF16_IN_FP32_MIN_ROWS - 1, 16, 300])
def test_bf16_packed_linear_rounds_fp32_sums(rows, monkeypatch):
    """Few rows run on the bf16 packed weight, from BF16_IN_FP32_MIN_ROWS on the fp32 copy;
    both give the fp32 sum of the same products, rounded to bf16 (one ulp apart at most)."""
    torch.manual_seed(rows)
    weight, bias = torch.randn(129, 200).bfloat16(), torch.randn(129).bfloat16()
    x = torch.randn(rows, 200).bfloat16()
    seen = []
    onednn_linear = fused.onednn_linear
    monkeypatch.setattr(
        fused, "onednn_linear", lambda a, p, b=None: seen.append(p.dtype) or onednn_linear(a, p, b)
    )
    # AVX2 alone: oneDNN packs no bf16, and few rows take torch's bf16 linear.
    packs_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    packed = onednn.pack(weight) if packs_bf16 else None
    out = fused.linear(x, weight, bias, BF16_KERNELS, packed, onednn.pack(weight.float()))
    if rows >= fused.BF16_IN_FP32_MIN_ROWS:
        assert seen == [torch.float32]
    else:
        assert seen == ([torch.bfloat16] if packs_bf16 else [])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, bf16_reference(x, weight, bias), rtol=8e-3, atol=1e-2)


def _bf16_linears(directory, **engine_args) -> list[Linear]:
    model = model_runner(small_engine(directory, dtype="bfloat16", **engine_args)).model
    return [m for m in model.modules() if isinstance(m, Linear)]


def test_every_bf16_linear_is_packed_with_an_fp32_copy_where_asked(tiny_model_factory, monkeypatch):
    directory = tiny_model_factory("LlamaForCausalLM:tied-bias")
    monkeypatch.setattr("pagedllm.ops.kernel_selection.bf16_matmul_native", lambda: False)
    linears = _bf16_linears(directory)
    assert linears and all(m.packed_fp32_weight.dtype == torch.float32 for m in linears)
    assert all(_has_bf16_copy(m) for m in linears)
    monkeypatch.setattr("pagedllm.ops.kernel_selection.bf16_matmul_native", lambda: True)
    linears = _bf16_linears(directory)
    assert all(_has_bf16_copy(m) and m.packed_fp32_weight is None for m in linears)


def _has_bf16_copy(linear: Linear) -> bool:
    """A bf16 packed copy exactly where oneDNN packs bf16 (AVX-512 BW/VL/DQ or AVX-NE-
    CONVERT: not on AVX2 alone, where packing bf16 raises)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return linear.packed_weight is None
    return linear.packed_weight is not None and linear.packed_weight.dtype == torch.bfloat16


def test_a_cpu_that_cannot_pack_bf16_keeps_the_fp32_copies(tiny_model_factory, monkeypatch):
    """On AVX2 alone oneDNN refuses bf16 packing: bf16 layers keep their fp32 copies (and
    multiply few rows with torch's bf16 linear) instead of failing to load."""
    directory = tiny_model_factory("LlamaForCausalLM")
    monkeypatch.setattr("pagedllm.ops.kernel_selection.bf16_matmul_native", lambda: False)
    monkeypatch.setattr(onednn, "_packs_in_own_dtype", lambda dtype: dtype == torch.float32)
    llm = small_engine(directory, dtype="bfloat16")
    linears = [m for m in model_runner(llm).model.modules() if isinstance(m, Linear)]
    assert all(m.packed_weight is None and m.packed_fp32_weight is not None for m in linears)
    prompt = {"prompt_token_ids": list(range(1, 20))}  # 19 rows: the fp32 copy, then one
    assert len(llm.generate([prompt], SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4


def test_the_fp32_copies_go_first_when_memory_is_short(tiny_model_factory, monkeypatch):
    directory = tiny_model_factory("LlamaForCausalLM")
    monkeypatch.setattr("pagedllm.ops.kernel_selection.bf16_matmul_native", lambda: False)
    # Room for 1.5 times the plain weights' bytes: the bf16 packed copies (as many bytes as
    # the plain weights) but not a further fp32 copy (twice that).
    plain = sum(m.weight.nbytes for m in _bf16_linears(directory))
    share = onednn.MAX_SHARE_OF_AVAILABLE_MEMORY
    monkeypatch.setattr(onednn, "available_memory_bytes", lambda: 1.5 * plain / share)
    linears = _bf16_linears(directory)
    assert all(_has_bf16_copy(m) and m.packed_fp32_weight is None for m in linears)
    # An operator who gives the packed copies twice the share (room for 3x) gets them.
    monkeypatch.setenv("PAGEDLLM_PACKED_WEIGHTS_SHARE", str(2 * share))
    assert all(m.packed_fp32_weight is not None for m in _bf16_linears(directory))
