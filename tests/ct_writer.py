"""Writing tiny Hugging Face models as compressed-tensors `pack-quantized` checkpoints
(llm-compressor's W4A16 / W8A16), for the compressed-tensors tests. llm-compressor is not
installed here, so the tensors follow the format's packing (compressed-tensors 0.20.1,
compressors/pack_quantized): per group (or output channel) round-to-nearest signed
integers, symmetric or with a zero point; `weight_packed` [N, K * bits / 32] packs each
row's values + 2^(bits-1) densely along the inputs; `weight_zero_point` (asymmetric) packs
the offset zero points the same way along the outputs; `weight_scale` [N, G] bf16, as
llm-compressor writes a bf16 model's; `weight_g_idx` with group activation order.

`reference_dequantize` is the format's dequantization, scale * (q - zero), read bit by bit
from the words in float64. The writer's packing was checked once against
compressed-tensors 0.20.1's own decompression (`PackedQuantizationCompressor.decompress`):
equal bit for bit in the scale's dtype (see tests/model/test_compressed_tensors.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gptq_writer import QUANTIZED_LAYERS, pack_int32, write_quantized_checkpoint


@dataclass(frozen=True)
class CTScheme:
    bits: int = 4
    group_size: int = 128  # -1: strategy "channel"
    symmetric: bool = True
    actorder: bool = False  # "group" activation order: a weight_g_idx per layer

    def quantization_config(self) -> dict:
        weights = {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": self.symmetric,
            "strategy": "channel" if self.group_size == -1 else "group",
            "group_size": None if self.group_size == -1 else self.group_size,
            "dynamic": False,
            "actorder": "group" if self.actorder else None,
            "observer": "minmax",
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": None,
                    "output_activations": None,
                    "format": "pack-quantized",
                }
            },
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
            "sparsity_config": {},
        }

    def __str__(self) -> str:
        groups = "channel" if self.group_size == -1 else f"g{self.group_size}"
        kind = "sym" if self.symmetric else "asym"
        return f"w{self.bits}a16-{groups}-{kind}" + ("-actorder" if self.actorder else "")


def _group_index(in_features: int, scheme: CTScheme, generator: torch.Generator):
    group_size = in_features if scheme.group_size == -1 else scheme.group_size
    groups = torch.arange(in_features) // group_size
    if not scheme.actorder:
        return groups
    g_idx = torch.empty_like(groups)
    g_idx[torch.randperm(in_features, generator=generator)] = groups
    return g_idx


def quantize_packed(
    weight: torch.Tensor, scheme: CTScheme, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A Linear weight [N, K] as the layer's pack-quantized tensors."""
    out_features, in_features = weight.shape
    low_q, high_q = -(2 ** (scheme.bits - 1)), 2 ** (scheme.bits - 1) - 1
    g_idx = _group_index(in_features, scheme, generator)
    groups = int(g_idx.max()) + 1
    w = weight.double()
    lows = torch.stack([w[:, g_idx == g].amin(1) for g in range(groups)], 1).clamp_max(0)
    highs = torch.stack([w[:, g_idx == g].amax(1) for g in range(groups)], 1).clamp_min(0)
    if scheme.symmetric:
        scales = torch.maximum(-lows, highs) / ((high_q - low_q) / 2)
        zeros = torch.zeros_like(scales, dtype=torch.long)
    else:
        scales = (highs - lows) / (high_q - low_q)
    scales = scales.clamp_min(1e-6).bfloat16()
    stored = scales.double()
    if not scheme.symmetric:
        zeros = torch.round(low_q - lows / stored).long().clamp(low_q, high_q)
    q = torch.round(w / stored[:, g_idx]).long() + zeros[:, g_idx]
    q = q.clamp(low_q, high_q) - low_q  # stored offset by 2^(bits-1)
    tensors = {
        "weight_packed": pack_int32(q, 1, scheme.bits),
        "weight_scale": scales,
        "weight_shape": torch.tensor([out_features, in_features]),
    }
    if not scheme.symmetric:
        tensors["weight_zero_point"] = pack_int32(zeros - low_q, 0, scheme.bits)
    if scheme.actorder:
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    return tensors


def _values(words: np.ndarray, count: int, bits: int) -> np.ndarray:
    """The first `count` densely packed `bits`-bit values along the last axis of int32
    `words`: value i is bits `bits * i % 32` up of word `bits * i // 32`."""
    starts = np.arange(count) * bits
    chosen = words.view(np.uint32)[..., starts // 32]
    return ((chosen >> (starts % 32).astype(np.uint32)) & np.uint32(2**bits - 1)).astype(np.int64)


def reference_dequantize(tensors: dict[str, torch.Tensor], scheme: CTScheme) -> torch.Tensor:
    """float32 [N, K]: scale[n, g] * (q[n, k] - zero[n, g]) with g the group of input k."""
    out_features, in_features = tensors["weight_shape"].tolist()
    scales = tensors["weight_scale"].double().numpy()
    offset = 2 ** (scheme.bits - 1)
    q = _values(tensors["weight_packed"].numpy(), in_features, scheme.bits) - offset
    if scheme.symmetric:
        zeros = np.zeros(scales.shape, dtype=np.int64)
    else:
        zero_words = np.ascontiguousarray(tensors["weight_zero_point"].numpy().T)  # [G, words]
        zeros = _values(zero_words, out_features, scheme.bits).T - offset
    group_size = in_features // scales.shape[1]
    g_idx = tensors.get("weight_g_idx", torch.arange(in_features) // group_size).long().numpy()
    weight = scales[:, g_idx] * (q - zeros[:, g_idx])
    return torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))


def write_ct_checkpoint(
    source: Path,
    quantized: Path,
    dequantized: Path,
    scheme: CTScheme,
    seed: int = 0,
    quantized_layers: tuple[str, ...] = QUANTIZED_LAYERS,
) -> int:
    """`write_gptq_checkpoint` for pack-quantized: returns the quantized tensors' bytes."""
    return write_quantized_checkpoint(
        source,
        quantized,
        dequantized,
        lambda weight, generator: quantize_packed(weight, scheme, generator),
        lambda tensors: reference_dequantize(tensors, scheme),
        scheme.quantization_config(),
        seed,
        quantized_layers,
    )
