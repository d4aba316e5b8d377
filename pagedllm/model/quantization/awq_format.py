"""AutoAWQ's GEMM-packed tensors, read into the integers and scales GPTQ's are read into.

Per quantized linear layer of K inputs and N outputs a checkpoint holds
- `qweight` int32 [K, N/8]: eight 4-bit weights of one input row per int32, along the
  outputs, interleaved: output column 8w + j sits in nibble `AWQ_SLOTS[j]` of word w
  (AutoAWQ packs columns in the order 0, 2, 4, 6, 1, 3, 5, 7);
- `qzeros` int32 [G, N/8]: the zero points packed the same way, stored as they are;
- `scales` fp16 [G, N]. Groups are consecutive input rows (no act-order, no g_idx).
Weight [n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = k // group_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.model.quantization.awq import AWQConfig
from pagedllm.model.quantization.gptq_format import (
    UnpackedGPTQ,
    checked_group_size,
    unpack_columns,
)

TENSOR_NAMES = ("qweight", "qzeros", "scales")
PACKED_PER_INT32 = 8
# Output column j of each 8 -> the nibble of its word that holds it.
AWQ_SLOTS = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class AWQTensors:
    """One layer's tensors as the checkpoint stores them."""

    qweight: torch.Tensor  # int32 [K, N/8]
    qzeros: torch.Tensor  # int32 [G, N/8]
    scales: torch.Tensor  # fp16 [G, N]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.qzeros, self.scales))


def unpack_awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C] in output-column order (undoing the interleave)."""
    nibbles = unpack_columns(packed)  # in slot order within each word
    columns = torch.arange(nibbles.shape[1])
    slots = torch.tensor(AWQ_SLOTS)[columns % PACKED_PER_INT32]
    return nibbles[:, columns - columns % PACKED_PER_INT32 + slots]


def unpack_awq(tensors: AWQTensors, config: AWQConfig) -> UnpackedGPTQ:
    """The integers and scales of one layer (see the module docstring)."""
    q = unpack_awq_columns(tensors.qweight)  # [K, N]
    rows, cols = q.shape
    group_size = checked_group_size(tensors.scales, rows, cols, config.group_size, "AWQ")
    groups = rows // group_size
    zeros = unpack_awq_columns(tensors.qzeros).float()
    if zeros.shape != (groups, cols):
        raise ValueError(f"AWQ qzeros unpack to {tuple(zeros.shape)}, not {(groups, cols)}")
    return UnpackedGPTQ(
        q.T, tensors.scales.float().T.contiguous(), zeros.T.contiguous(), None,
        group_size,
    )  # fmt: skip
