"""The one decision of which kernels run: torch's references wherever the C++ kernels do not
apply (another device, no AVX2/FMA, no extension, fused ops for models neither fp32 nor
bf16, attention_backend "torch"), the kernels exactly where they ran before; bf16 matmuls in
fp32 where the CPU's bf16 dot products are slow; and everything in the engine (layers,
attention backend, sampler) follows the same decision object."""

from __future__ import annotations

import logging

import pytest
import torch
from model_utils import model_runner

from pagedllm import LLM
from pagedllm.ops import extension, fused, kernel_selection
from pagedllm.ops.cpu_features import CpuFeatures, cpu_features
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection, select_kernels

needs_kernels = pytest.mark.skipif(not extension.available(), reason="no AVX2 compiler here")


def select(device="cpu", dtype=torch.float32, backend="cpu", head_dim=64, cache=None):
    return select_kernels(device, dtype, backend, head_dim=head_dim, cache_dtype=cache or dtype)


@pytest.fixture
def fresh_log(monkeypatch):
    monkeypatch.setattr(kernel_selection, "_unavailable_logged", False)


def test_torch_backend_asks_for_the_references_everywhere():
    assert select(backend="torch") is TORCH_KERNELS


@pytest.mark.parametrize("device", ["cuda", "meta", torch.device("cuda", 1)])
def test_other_devices_run_the_references(device):
    assert select(device=device) is TORCH_KERNELS


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention_backend 'flash' is unknown"):
        select(backend="flash")


@needs_kernels
def test_fp32_model_on_this_cpu_runs_every_kernel():
    assert select() == KernelSelection(attention="cpu", fused_ops=True, sampler_draw=True)


@needs_kernels
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("amx", [True, False])
def test_bf16_model_runs_every_kernel(native, amx, monkeypatch):
    # The element-wise kernels take bf16; the sampler upcasts logits, so its draw stays.
    monkeypatch.setattr(kernel_selection, "bf16_matmul_native", lambda: native)
    monkeypatch.setattr(kernel_selection, "amx_tiles_granted", lambda: amx)
    monkeypatch.setattr(kernel_selection, "bf16_dot_granted", lambda: True)
    assert select(dtype=torch.bfloat16) == KernelSelection(
        "cpu",
        fused_ops=True,
        sampler_draw=True,
        bf16_matmul_in_fp32=not native,
        bf16_amx_linear=amx,
        # Fast dot products without tiles: the decode rows' own AVX512-BF16 kernel, and the
        # attention's prefill tiles on them.
        bf16_dot_linear=native and not amx,
        bf16_amx_attention=amx,
        bf16_dot_attention=native and not amx,
    )
    expected_tiles = "amx" if amx else "bf16_dots" if native else None
    assert select(dtype=torch.bfloat16).attention_tiles == expected_tiles
    fp32 = select(dtype=torch.float32)
    assert not fp32.bf16_matmul_in_fp32 and not fp32.bf16_amx_linear
    assert not fp32.bf16_dot_linear
    assert not fp32.bf16_amx_attention and fp32.attention_tiles is None
    # The attention tiles read a bf16 cache only.
    fp32_cache = select(dtype=torch.bfloat16, cache=torch.float32)
    assert fp32_cache.attention_tiles is None


@pytest.fixture
def measured_again():
    """bf16_matmul_native measures once a process: the test's answer must not stay."""
    kernel_selection.bf16_matmul_native.cache_clear()
    yield
    kernel_selection.bf16_matmul_native.cache_clear()


@pytest.mark.parametrize(
    ("flags", "ratio", "native"),
    [
        ((), 9.0, False),  # no bf16 dot products: bf16 is converted to fp32 anyway
        (("avx512_bf16",), 2.0, True),  # a full-rate vdpbf16ps (AMD Zen 4)
        (("avx512_bf16",), 0.5, False),  # half the FMA rate (Intel without AMX)
        (("avx512_bf16", "amx_tile", "amx_bf16"), 0.5, True),  # oneDNN takes AMX tiles
    ],
)
def test_bf16_matmuls_are_native_where_they_beat_fp32(
    flags, ratio, native, monkeypatch, measured_again
):
    on_a_cpu_with(monkeypatch, flags, bf16_dot_speed_ratio=lambda: ratio)
    assert kernel_selection.bf16_matmul_native() is native


def on_a_cpu_with(monkeypatch, flags: tuple[str, ...], **kernel_answers) -> None:
    """The selection sees an AVX-512 CPU with `flags` besides, and an extension whose ops
    answer as `kernel_answers` (name -> function) say."""
    features = CpuFeatures.from_flags({"avx2", "fma", "avx512f", *flags})
    monkeypatch.setattr(kernel_selection, "cpu_features", lambda: features)
    kernel = type("Kernel", (), {name: staticmethod(f) for name, f in kernel_answers.items()})
    monkeypatch.setattr(extension, "load", kernel)


@pytest.mark.parametrize(
    ("flags", "granted", "tiles"),
    [
        (("avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"), True, True),
        (("avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"), False, False),  # Linux refused
        (("avx512bw", "avx512_bf16"), True, False),  # no AMX (Zen 4, or hidden)
        (("avx512bw", "amx_tile", "amx_bf16"), True, False),  # AVX512-BF16 hidden
    ],
)
def test_bf16_decode_matmuls_take_amx_tiles_where_granted(flags, granted, tiles, monkeypatch):
    on_a_cpu_with(monkeypatch, flags, amx_available=lambda: granted)
    kernel_selection.amx_tiles_granted.cache_clear()
    try:
        assert kernel_selection.amx_tiles_granted() is tiles
    finally:
        kernel_selection.amx_tiles_granted.cache_clear()


@needs_kernels
def test_the_probe_measures_bf16_dot_products_only_where_the_cpu_has_them():
    ratio = extension.load().bf16_dot_speed_ratio()
    if cpu_features().avx512_bf16:
        assert 0.1 < ratio < 10  # a rate, measured (0.5 on Intel without AMX, 2 on Zen 4)
    else:
        assert ratio == 0


@needs_kernels
def test_fp16_model_keeps_attention_and_draw_kernels():
    assert select(dtype=torch.float16) == KernelSelection("cpu", fused_ops=False, sampler_draw=True)


@needs_kernels
def test_16_bit_cache_under_fp32_model_keeps_the_attention_kernel():
    assert select(cache=torch.bfloat16).attention == "cpu"


@needs_kernels
def test_head_dim_outside_the_kernel_runs_torch_attention_only():
    assert select(head_dim=24) == KernelSelection("torch", fused_ops=True, sampler_draw=True)


def test_cpu_without_avx2_runs_the_references(monkeypatch, caplog, fresh_log):
    monkeypatch.setattr(kernel_selection, "kernel_isa_missing", lambda: "the CPU lacks AVX2")
    with caplog.at_level(logging.ERROR, logger=kernel_selection.__name__):
        assert select() is TORCH_KERNELS
        assert select() is TORCH_KERNELS
    assert caplog.text.count("the CPU lacks AVX2") == 1 and "falling back" in caplog.text


def test_build_failure_runs_the_references(monkeypatch, caplog, fresh_log):
    def broken() -> None:
        raise RuntimeError("the CPU extension is unavailable: no compiler")

    monkeypatch.setattr(kernel_selection, "kernel_isa_missing", lambda: None)
    monkeypatch.setattr(extension, "load", broken)
    with caplog.at_level(logging.ERROR, logger=kernel_selection.__name__):
        assert select() is TORCH_KERNELS
    assert "no compiler" in caplog.text and "falling back" in caplog.text


def test_fused_ops_never_touch_the_extension_under_torch_kernels(monkeypatch):
    def unavailable() -> None:
        raise AssertionError("the extension was asked for")

    monkeypatch.setattr(fused, "load", unavailable)
    x, weight = torch.randn(3, 16), torch.randn(16)
    fused.rms_norm(x, weight, 1e-6, kernels=TORCH_KERNELS)
    fused.linear(x, torch.randn(8, 16), kernels=TORCH_KERNELS)
    fused.silu_and_mul(x, kernels=TORCH_KERNELS)
    fused.sample_plain(x, torch.ones(3), torch.rand(3), kernels=TORCH_KERNELS)


@needs_kernels
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_engine_shares_one_decision(tiny_llama, backend):
    llm = LLM(str(tiny_llama), max_model_len=64, attention_backend=backend)
    runner = model_runner(llm)
    expected = select(backend=backend, head_dim=runner.config.model_config.head_dim)
    assert runner.kernels == expected
    model = runner.model
    holders = [m for m in model.modules() if hasattr(m, "kernels")]
    assert len(holders) > 1 and all(m.kernels is runner.kernels for m in holders)
    assert runner.sampler.kernels is runner.kernels
    assert runner.attention_backend.name == expected.attention
    assert {m.backend for m in model.modules() if hasattr(m, "backend")} == {
        runner.attention_backend
    }
