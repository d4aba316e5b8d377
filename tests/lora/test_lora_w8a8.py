"""LoRA on an 8-bit checkpoint (int8 W8A8, FP8): the adapters' deltas run in fp32 beside
the 8-bit layers, on the unquantized input. Greedy tokens equal Transformers + PEFT on the
dequantized model (ties counted): with the adapter merged into it for weight-only int8;
with activations quantized, PEFT's unmerged forward with the same fake-quantization on its
base layers' input only, which is what the engine computes (a merged adapter would see the
quantized input). The adapters change the answers."""

from __future__ import annotations

import pytest
from lora_greedy import check_adapters_on_quantized_base
from lora_utils import merged_model, peft_model
from quantized_llama import make_quantizable_llama
from w8a8_writer import add_activation_quantization, format_named, write_w8a8_checkpoint

from pagedllm.model.layers.w8a8_linear import Int8W8A8Linear, TiledDequantLinear


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_quantizable_llama(tmp_path_factory)


def _reference(dequantized, adapter, fmt):
    if fmt.activations is None:
        return merged_model(dequantized, adapter)
    model = peft_model(dequantized, adapter)
    add_activation_quantization(model, fmt)
    return model


@pytest.mark.parametrize(
    "name", ["ct-int8-weight-only", "ct-int8-token", "fp8-block"], ids=lambda n: n
)
def test_8_bit_base_with_adapters_equals_peft_on_the_dequantized_model(
    tiny_llama, tmp_path, report_ties, name
):
    fmt = format_named(name)
    quantized, dequantized = tmp_path / "w8a8", tmp_path / "dequantized"
    write_w8a8_checkpoint(tiny_llama, quantized, dequantized, fmt)
    check_adapters_on_quantized_base(
        quantized,
        dequantized,
        tmp_path,
        (Int8W8A8Linear, TiledDequantLinear),
        lambda adapter: _reference(dequantized, adapter, fmt),
        report_ties,
    )
