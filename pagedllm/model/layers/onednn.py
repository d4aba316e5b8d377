"""fp32 and bf16 linear layers on oneDNN with their weights prepacked once, at load (CPU).

torch's `F.linear` runs MKL's sgemm, which repacks the weight on every call and, on this
machine's AMD CPU, takes its AVX2 code path. oneDNN keeps the weight in its own blocked
layout and uses AVX-512 where the CPU has it: the default model's projections at 2,048 rows
ran at 217 GFLOP/s against sgemm's 155, and at 64 rows in 86 ms against the skinny kernel's
125 (benchmarks/results/matmul.md; docs/performance.md, "oneDNN").
The packed copy sits beside the plain weight, which the skinny kernel still reads for one
to three rows and the embedding lookup for the tied head, so fp32 weights take twice their
memory.

A bf16 weight is packed as bf16. Where the CPU's bf16 matmuls lose to fp32 ones (no AMX,
AVX512-BF16 at half the FMA rate or absent: `KernelSelection.bf16_matmul_in_fp32`) it
gets an fp32 packed copy too: batches of `fused.BF16_IN_FP32_MIN_ROWS` rows or more
multiply on it at the fp32 rate, with the same products, while fewer rows, bound by
reading the weights, keep the bf16 copy's half-size reads. The fp32 copy is dropped first
when memory is short.
"""

from __future__ import annotations

import logging
import os

import torch

from pagedllm.model.layers.linear import Linear

logger = logging.getLogger(__name__)

# The batch size oneDNN is told to expect when packing; the packed weight serves any.
_PACKING_ROWS = 2048


def available() -> bool:
    """oneDNN's packed linear is in this torch build and not turned off
    (PAGEDLLM_ONEDNN=0)."""
    return (
        os.environ.get("PAGEDLLM_ONEDNN", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACKING_ROWS)


# Packed copies may take at most this share of the memory available when packing starts:
# a large fp32 model keeps its plain weights alone rather than run out of memory.
MAX_SHARE_OF_AVAILABLE_MEMORY = 0.25


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Give every fp32 or bf16 CPU `Linear` of the model (a tied head included) a packed
    weight, and bf16 ones an fp32 packed copy where the kernels ask for it; returns how many
    weights were packed (0 where oneDNN is unavailable or the copies would not fit in
    MAX_SHARE_OF_AVAILABLE_MEMORY of the available memory)."""
    if not available():
        return 0
    linears = [
        module
        for module in model.modules()
        if isinstance(module, Linear) and _packable(module.weight)
    ]
    in_fp32 = [linear for linear in linears if _wants_fp32_copy(linear)]
    packed_bytes = sum(linear.weight.nbytes for linear in linears)
    fp32_bytes = sum(linear.weight.numel() * 4 for linear in in_fp32)
    budget = MAX_SHARE_OF_AVAILABLE_MEMORY * available_memory_bytes()
    if packed_bytes + fp32_bytes > budget:
        in_fp32, fp32_bytes = [], 0
    if packed_bytes > budget:
        logger.warning(
            "oneDNN packing skipped: the packed weights (%.1f GB) would exceed %.0f%% of the "
            "available memory; linear layers use sgemm",
            packed_bytes / 1e9,
            100 * MAX_SHARE_OF_AVAILABLE_MEMORY,
        )
        return 0
    for linear in linears:
        linear.packed_weight = pack(linear.weight)
    for linear in in_fp32:
        linear.packed_fp32_weight = pack(linear.weight.float())
    logger.info(
        "Packed %d linear weights for oneDNN (%.0f MB%s)",
        len(linears),
        (packed_bytes + fp32_bytes) / 1e6,
        f", {len(in_fp32)} with fp32 copies for bf16 batches" if in_fp32 else "",
    )
    return len(linears)


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the free physical pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _packable(weight: torch.Tensor) -> bool:
    return (
        weight.dtype in (torch.float32, torch.bfloat16)
        and weight.device.type == "cpu"
        and weight.dim() == 2
    )


def _wants_fp32_copy(linear: Linear) -> bool:
    return linear.weight.dtype == torch.bfloat16 and linear.kernels.bf16_matmul_in_fp32
