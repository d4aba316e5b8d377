"""bf16 linear weights in AMX tiles' layout, for the few rows of decode steps.

A bf16 layer keeps its oneDNN packed weight for prefill chunks and gains this copy where
the kernels choose AMX (`KernelSelection.bf16_amx_linear`): `fused.linear` multiplies up to
`fused.AMX_MAX_ROWS` rows on it (`ops/csrc/amx_linear.cpp`). Where they choose AVX512-BF16
dot products instead (`bf16_dot_linear`, CPUs without AMX) the same copy serves
`ops/csrc/bf16_dot_linear.cpp`. The kernel takes layers whose
input and output sizes are multiples of 32; others keep oneDNN alone.
"""

from __future__ import annotations

import torch

from pagedllm.ops.extension import load

# The kernel's block: 32 output columns over 32 of the reduction at a time.
TILE_MULTIPLE = 32


def fits(weight: torch.Tensor) -> bool:
    """Whether the AMX kernel takes this weight: 2-D bf16 on the CPU, both sizes multiples of
    TILE_MULTIPLE."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[0] % TILE_MULTIPLE == 0
        and weight.shape[1] % TILE_MULTIPLE == 0
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in the kernel's layout, [N/32, K/32, 16, 32, 2]."""
    return load().amx_pack_weight(weight.detach())
