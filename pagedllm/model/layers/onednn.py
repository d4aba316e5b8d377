"""fp32 linear layers on oneDNN with their weights prepacked once, at load (CPU).

torch's `F.linear` runs MKL's sgemm, which repacks the weight on every call and, on this
machine's AMD CPU, takes its AVX2 code path. oneDNN keeps the weight in its own blocked
layout and uses AVX-512 where the CPU has it: the default model's projections at 2,048 rows
ran at 217 GFLOP/s against sgemm's 155, and at 64 rows in 86 ms against the skinny kernel's
125 (benchmarks/results/matmul.md; docs/performance.md, "oneDNN").
The packed copy sits beside the plain weight, which the skinny kernel still reads for one
to three rows and the embedding lookup for the tied head, so fp32 weights take twice their
memory.
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
    """Give every fp32 CPU `Linear` of the model (a tied head included) a packed weight; returns
    how many weights were packed (0 where oneDNN is unavailable or the copies would not
    fit in MAX_SHARE_OF_AVAILABLE_MEMORY of the available memory)."""
    if not available():
        return 0
    linears = [
        module
        for module in model.modules()
        if isinstance(module, Linear) and _packable(module.weight)
    ]
    needed = sum(linear.weight.nbytes for linear in linears)
    budget = MAX_SHARE_OF_AVAILABLE_MEMORY * available_memory_bytes()
    if needed > budget:
        logger.warning(
            "oneDNN packing skipped: the packed weights (%.1f GB) would exceed %.0f%% of the "
            "available memory; linear layers use sgemm",
            needed / 1e9,
            100 * MAX_SHARE_OF_AVAILABLE_MEMORY,
        )
        return 0
    for linear in linears:
        linear.packed_weight = pack(linear.weight)
    logger.info("Packed %d linear weights for oneDNN (%.0f MB)", len(linears), needed / 1e6)
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
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
