"""The private and deprecated torch entry points the kernels rely on, one test each.

torch keeps no promise about these: oneDNN's packed linear (`torch.ops.mkldnn`), fbgemm's
dynamic int8 GEMM through quantized tensors (deprecated with torch.ao's quantization), and
the CPU capability probes under `torch.cpu`. pagedllm pins torch (its wheel
is compiled against it), so a failure here is the first thing an upgrade meets: each names
the torch version, the entry point and the pagedllm code that calls it, instead of a wrong
number or a silent fallback deep in a model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model.layers import onednn
from pagedllm.model.layers.quantization import Int8Linear, _quantized_engine, quantize_weight
from pagedllm.ops.fused import onednn_linear


@contextmanager
def entry_point(name: str, used_by: str) -> Iterator[None]:
    """Any failure inside becomes one that says what changed, where, and in which torch."""
    try:
        yield
    except Exception as error:
        pytest.fail(
            f"torch {torch.__version__}: {name} no longer behaves as {used_by} expects "
            f"({type(error).__name__}: {error}); check it before moving the torch pin",
            pytrace=False,
        )


def _attribute(owner: object, path: str) -> Callable:
    for part in path.split("."):
        owner = getattr(owner, part)
    assert callable(owner), f"{path} is not callable"
    return owner


def _close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    error = (actual - expected).abs().max().item()
    assert error <= tolerance * expected.abs().max().item(), f"max error {error}"


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(48, 64, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(5, 64, generator=torch.Generator().manual_seed(1))


def test_mkldnn_linear_pointwise_multiplies_a_packed_weight(weight, x):
    bias = torch.randn(48)
    with entry_point(
        "torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise",
        "model/layers/onednn.py and ops/fused.py's onednn_linear",
    ):
        assert torch.backends.mkldnn.is_available()
        assert onednn.available(), "oneDNN's packed linear is missing from this build"
        packed = onednn.pack(weight)
        _close(onednn_linear(x, packed, bias), F.linear(x, weight, bias), 1e-5)
        _close(onednn_linear(x, packed), F.linear(x, weight), 1e-5)


def test_mkldnn_bf16_support_probe_answers():
    with entry_point(
        "torch.ops.mkldnn._is_mkldnn_bf16_supported", "model/layers/onednn.py (bf16 packing)"
    ):
        assert isinstance(bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()), bool)


def test_fbgemm_dynamic_int8_linear(weight, x):
    with entry_point(
        "the fbgemm engine, torch.quantize_per_channel and torch.ops.quantized."
        "linear_prepack / linear_dynamic / linear_unpack",
        "model/layers/quantization.py (quantization='int8')",
    ):
        assert "fbgemm" in torch.backends.quantized.supported_engines
        layer = Int8Linear(weight, None)
        # Per-channel int8 weights and 7- or 8-bit activations: ~1% of the output's range.
        _close(layer(x), F.linear(x, weight), 0.03)
        _close(layer(x[:1]), F.linear(x[:1], weight), 0.03)  # the lone-row path
        unpacked, _ = layer.unpack()
        assert unpacked.dtype == torch.qint8 and unpacked.shape == weight.shape
        assert torch.equal(unpacked.int_repr(), quantize_weight(weight).int_repr())


def _integer_operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 activations and weights over their full range, and their exact int64 product."""
    generator = torch.Generator().manual_seed(0)
    q_x = torch.randint(-128, 128, (5, 64), generator=generator, dtype=torch.int8)
    q_w = torch.randint(-128, 128, (24, 64), generator=generator, dtype=torch.int8)
    return q_x, q_w, q_x.long() @ q_w.long().T


def test_int_mm_multiplies_int8_exactly():
    with entry_point("torch._int_mm", "model/layers/w8a8_linear.py (int8 W8A8, no VNNI)"):
        q_x, q_w, exact = _integer_operands()
        assert torch.equal(torch._int_mm(q_x, q_w.T).long(), exact)


def test_fbgemm_keeps_integer_inputs_with_a_range_row():
    """Int8W8A8Linear feeds fbgemm integers plus a row of -128 and 127, which makes fbgemm's
    per-tensor input quantization the identity (used where the CPU has VNNI)."""
    with entry_point(
        "torch._make_per_channel_quantized_tensor and torch.ops.quantized.linear_dynamic "
        "(reduce_range False) on integer-valued inputs",
        "model/layers/w8a8_linear.py (int8 W8A8 checkpoints)",
    ):
        q_x, q_w, exact = _integer_operands()
        scales = torch.ones(q_w.shape[0], dtype=torch.double)
        zero_points = torch.zeros(q_w.shape[0], dtype=torch.long)
        weight = torch._make_per_channel_quantized_tensor(q_w, scales, zero_points, 0)
        with _quantized_engine("fbgemm"):
            packed = torch.ops.quantized.linear_prepack(weight, None)
            rows = torch.cat([q_x.float(), torch.zeros(1, q_x.shape[1])])
            rows[-1, :2] = torch.tensor([-128.0, 127.0])
            product = torch.ops.quantized.linear_dynamic(rows, packed, False)[:-1]
        if torch.cpu._is_vnni_supported():  # without VNNI the layer takes torch._int_mm
            assert torch.equal(product.long(), exact)


def test_quantized_engine_can_be_switched():
    with (
        entry_point("torch.backends.quantized.engine", "model/layers/quantization.py"),
        _quantized_engine("fbgemm"),
    ):
        assert torch.backends.quantized.engine == "fbgemm"


@pytest.mark.parametrize(
    ("path", "used_by"),
    [
        (
            "cpu._is_vnni_supported",
            "ops/cpu_features.py, model/layers/quantization.py, model/layers/w8a8_linear.py",
        ),
        ("cpu._is_avx512_bf16_supported", "ops/cpu_features.py"),
        ("cpu._is_amx_tile_supported", "ops/cpu_features.py"),
        ("backends.cpu.get_cpu_capability", "ops/cpu_features.py"),
    ],
)
def test_cpu_capability_probes_exist(path, used_by):
    """The callers fall back quietly where a probe is missing (a CPU feature then looks absent
    and its kernels never run): only this test notices."""
    with entry_point(f"torch.{path}", used_by):
        probe = _attribute(torch, path)
        answer = probe()
        assert isinstance(answer, bool | str), f"answered {answer!r}"
