"""One scheme of each checkpoint format the test writers produce (GPTQ, GPTQ act-order, AWQ,
compressed-tensors W4A16, int8 W8A8, FP8), by name, for tests that write any architecture
in several of them (tests/model/test_quantized_architectures.py): how a layer's weight is
quantized and dequantized, the config.json `quantization_config`, and the 8-bit activation
quantization Transformers must add to compute what the engine computes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import awq_writer
import ct_writer
import gptq_writer
import torch
import w8a8_writer

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class CheckpointFormat:
    name: str
    quantize: Callable[[torch.Tensor, torch.Generator], Tensors]  # a weight [N, K] as stored
    dequantize: Callable[[Tensors], torch.Tensor]  # the format's own dequantization
    config: dict[str, Any]  # its quantization_config
    activations: w8a8_writer.Format | None = None  # 8-bit: how activations are quantized

    def __str__(self) -> str:
        return self.name

    @property
    def method(self) -> str:
        return self.config["quant_method"]

    def write(
        self,
        source: Path,
        quantized: Path,
        dequantized: Path,
        layers: tuple[str, ...] = gptq_writer.QUANTIZED_LAYERS,
    ) -> int:
        """The fp32 model in `source` as this format's checkpoint (`quantized`) and as the
        fp32 model of its dequantized weights (`dequantized`): the modules named in `layers`
        (every decoder projection, fused ones, Phi-3's, as they are stored) quantized.
        Returns the quantized tensors' bytes."""
        return gptq_writer.write_quantized_checkpoint(
            source, quantized, dequantized, self.quantize, self.dequantize, self.config,
            quantized_layers=layers,
        )  # fmt: skip

    def add_activation_quantization(self, hf_model: torch.nn.Module) -> None:
        """Make Transformers' model quantize the projections' inputs as the engine does."""
        if self.activations is not None:
            w8a8_writer.add_activation_quantization(hf_model, self.activations)


def _gptq(name: str, scheme: gptq_writer.Scheme) -> CheckpointFormat:
    return CheckpointFormat(
        name,
        lambda weight, generator: gptq_writer.quantize_weight(weight, scheme, generator),
        lambda tensors: gptq_writer.reference_dequantize(tensors, scheme),
        scheme.quantization_config(),
    )


def _awq(name: str, scheme: awq_writer.AWQScheme) -> CheckpointFormat:
    return CheckpointFormat(
        name,
        lambda weight, generator: awq_writer.quantize_awq(weight, scheme, generator),
        lambda tensors: awq_writer.reference_dequantize(tensors, scheme),
        scheme.quantization_config(),
    )


def _pack_quantized(name: str, scheme: ct_writer.CTScheme) -> CheckpointFormat:
    return CheckpointFormat(
        name,
        lambda weight, generator: ct_writer.quantize_packed(weight, scheme, generator),
        lambda tensors: ct_writer.reference_dequantize(tensors, scheme),
        scheme.quantization_config(),
    )


def _eight_bit(name: str, stored: str) -> CheckpointFormat:
    fmt = w8a8_writer.format_named(stored)
    return CheckpointFormat(
        name,
        lambda weight, generator: w8a8_writer.quantize_weight(weight, fmt),
        lambda tensors: w8a8_writer.reference_dequantize(tensors, fmt),
        fmt.quantization_config(),
        fmt,
    )


FORMATS = {
    fmt.name: fmt
    for fmt in (
        _gptq("gptq-g128", gptq_writer.Scheme(128, desc_act=False, sym=True)),
        _gptq("gptq-g32-act-order", gptq_writer.Scheme(32, desc_act=True, sym=False)),
        _awq("awq-g128", awq_writer.AWQScheme(128)),
        _pack_quantized("w4a16-g128", ct_writer.CTScheme(4, 128, symmetric=False)),
        # int8 weights per channel, int8 activations per token
        _eight_bit("w8a8-int8", "ct-int8-token"),
        # quant_method "fp8": 128 x 128 weight blocks, activations per token and group of 128
        _eight_bit("fp8-block", "fp8-block"),
        # compressed-tensors FP8 per channel, activations per token
        _eight_bit("fp8-dynamic", "ct-fp8-dynamic"),
    )
}
