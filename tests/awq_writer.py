"""Writing tiny Hugging Face models as AutoAWQ GEMM checkpoints, for the AWQ tests: AutoAWQ
needs a GPU to quantize, so the packing follows its GEMM layout (AutoAWQ 0.2.9,
awq/modules/linear/gemm.py): per group of input rows round-to-nearest with a zero point
(not AWQ's activation-aware search: the layout is what is tested); `qweight` [K, N/8] and
`qzeros` [G, N/8] hold eight 4-bit values a word along the outputs, nibble i of word w
holding column 8w + AWQ_ORDER[i]; `scales` [G, N] fp16.

`reference_dequantize` is the format's dequantization, scales * (q - zeros) per group, read
nibble by nibble in AutoAWQ's packing order (not the reader's inverse table) in float64.
The writer's packing was checked once against AutoAWQ 0.2.9's own unpacking
(`awq.utils.packing_utils.dequantize_gemm`): equal bit for bit (see tests/model/test_awq.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gptq_writer import QUANTIZED_LAYERS, write_quantized_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8w + AWQ_ORDER[i]
MAX_Q = 15


@dataclass(frozen=True)
class AWQScheme:
    group_size: int = 128
    version: str = "gemm"
    not_converted: tuple[str, ...] = ()  # projections left fp32 (`modules_to_not_convert`)

    def quantization_config(self) -> dict:
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": self.group_size,
            "zero_point": True,
            "version": self.version,
            "modules_to_not_convert": list(self.not_converted) or None,
        }

    def __str__(self) -> str:
        return f"awq-g{self.group_size}" + "".join(f"-{m}-fp32" for m in self.not_converted)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """uint 4-bit [R, C] -> int32 [R, C/8] in AutoAWQ's interleaved order."""
    columns = values.long().reshape(values.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]
    packed = (columns << (4 * torch.arange(8))).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def quantize_awq(
    weight: torch.Tensor, scheme: AWQScheme, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """A Linear weight [N, K] as qweight, qzeros, scales."""
    out_features, in_features = weight.shape
    group_size = in_features if scheme.group_size == -1 else scheme.group_size
    grouped = weight.double().reshape(out_features, -1, group_size)  # [N, G, g]
    low, high = grouped.amin(2).clamp_max(0), grouped.amax(2).clamp_min(0)
    scales = ((high - low) / MAX_Q).clamp_min(1e-6).half()  # [N, G]
    stored = scales.double()
    zeros = torch.round(-low / stored).long().clamp(0, MAX_Q)
    q = (torch.round(grouped / stored[..., None]).long() + zeros[..., None]).clamp(0, MAX_Q)
    return {
        "qweight": pack_awq(q.reshape(out_features, in_features).T),
        "qzeros": pack_awq(zeros.T),
        "scales": scales.T.contiguous(),
    }


def _unpack_reference(packed: np.ndarray) -> np.ndarray:
    """int32 [R, C] -> [R, 8C] nibble by nibble: nibble i of word w is column 8w + ORDER[i]."""
    words = packed.view(np.uint32)
    values = np.empty((words.shape[0], words.shape[1] * 8), dtype=np.int64)
    for i, column in enumerate(AWQ_ORDER):
        values[:, column::8] = (words >> np.uint32(4 * i)) & 0xF
    return values


def reference_dequantize(tensors: dict[str, torch.Tensor], scheme: AWQScheme) -> torch.Tensor:
    """float32 [N, K]: scales[k // g, n] * (q[k, n] - zeros[k // g, n])."""
    q = _unpack_reference(tensors["qweight"].numpy())  # [K, N]
    zeros = _unpack_reference(tensors["qzeros"].numpy())  # [G, N]
    scales = tensors["scales"].numpy().astype(np.float64)
    group_size = q.shape[0] // scales.shape[0]
    weight = scales.repeat(group_size, 0) * (q - zeros.repeat(group_size, 0))
    return torch.from_numpy(weight.T.astype(np.float32)).contiguous()


def write_awq_checkpoint(
    source: Path,
    quantized: Path,
    dequantized: Path,
    scheme: AWQScheme,
    seed: int = 0,
    quantized_layers: tuple[str, ...] = QUANTIZED_LAYERS,
) -> int:
    """`write_gptq_checkpoint` for AWQ: returns the AWQ tensors' bytes."""
    return write_quantized_checkpoint(
        source,
        quantized,
        dequantized,
        lambda weight, generator: quantize_awq(weight, scheme, generator),
        lambda tensors: reference_dequantize(tensors, scheme),
        scheme.quantization_config(),
        seed,
        tuple(layer for layer in quantized_layers if layer not in scheme.not_converted),
    )
