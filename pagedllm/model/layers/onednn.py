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
when memory is short. Where the CPU has AMX (`KernelSelection.bf16_amx_linear`), or fast
AVX512-BF16 dot products and no AMX (`bf16_dot_linear`), a bf16 weight gets a copy in AMX
tiles' layout instead (`amx_tiles.py`) for decode steps' few rows, which oneDNN serves with
more host work than kernel time; it is dropped before the oneDNN copy.
"""

from __future__ import annotations

import logging
import os

import torch

from pagedllm.model.layers import amx_tiles
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


# Packed copies may take at most this share of the memory available when packing starts
# (PAGEDLLM_PACKED_WEIGHTS_SHARE overrides it): a large fp32 model keeps its plain weights
# alone rather than run out of memory, and a bf16 one drops its fp32 copies first. A
# quarter left Llama-3.2-1B's shape unpacked on a 24 GiB machine (4.9 GB of fp32 copies
# against ~4 GB allowed) and its 32-sequence batches 35-40% slower, in fp32 and bf16 alike
# (benchmarks/results/bf16.md); half still leaves half of what is available.
MAX_SHARE_OF_AVAILABLE_MEMORY = 0.5


def packing_budget_bytes() -> float:
    """The bytes packed copies may take now."""
    share = float(os.environ.get("PAGEDLLM_PACKED_WEIGHTS_SHARE", MAX_SHARE_OF_AVAILABLE_MEMORY))
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"PAGEDLLM_PACKED_WEIGHTS_SHARE must be in [0, 1], got {share}")
    return share * available_memory_bytes()


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Give every fp32 or bf16 CPU `Linear` of the model (a tied head included) a packed
    weight (bf16 ones where oneDNN packs bf16 on this CPU), and bf16 ones an fp32 packed copy
    where the kernels ask for it; returns how many layers got a packed copy (0 where oneDNN is
    unavailable or the copies would not fit in `packing_budget_bytes`)."""
    if not available():
        return 0
    candidates = [
        module
        for module in model.modules()
        if isinstance(module, Linear) and _packable(module.weight)
    ]
    linears = [linear for linear in candidates if _packs_in_own_dtype(linear.weight.dtype)]
    in_fp32 = [linear for linear in candidates if _wants_fp32_copy(linear)]
    in_tiles = [linear for linear in candidates if _wants_tile_copy(linear)]
    packed_bytes = sum(linear.weight.nbytes for linear in linears)
    fp32_bytes = sum(linear.weight.numel() * 4 for linear in in_fp32)
    tile_bytes = sum(linear.weight.nbytes for linear in in_tiles)
    budget = packing_budget_bytes()
    if packed_bytes + fp32_bytes + tile_bytes > budget and in_tiles:
        logger.warning(
            "bf16 layers keep no tile-layout copies: with them the packed weights (%.1f GB) "
            "would exceed %.1f GB (PAGEDLLM_PACKED_WEIGHTS_SHARE); decode steps use oneDNN",
            (packed_bytes + fp32_bytes + tile_bytes) / 1e9,
            budget / 1e9,
        )
        in_tiles, tile_bytes = [], 0
    if packed_bytes + fp32_bytes > budget and in_fp32:
        logger.warning(
            "bf16 layers keep no fp32 copies: with them the packed weights (%.1f GB) would "
            "exceed %.1f GB (PAGEDLLM_PACKED_WEIGHTS_SHARE); batches multiply in bf16",
            (packed_bytes + fp32_bytes) / 1e9,
            budget / 1e9,
        )
        in_fp32, fp32_bytes = [], 0
    if packed_bytes > budget:
        logger.warning(
            "oneDNN packing skipped: the packed weights (%.1f GB) would exceed %.1f GB, the "
            "share of the available memory they may take (PAGEDLLM_PACKED_WEIGHTS_SHARE); "
            "linear layers use sgemm",
            packed_bytes / 1e9,
            budget / 1e9,
        )
        return 0
    for linear in linears:
        linear.packed_weight = pack(linear.weight)
    for linear in in_fp32:
        linear.packed_fp32_weight = pack(linear.weight.float())
    for linear in in_tiles:
        linear.packed_amx_weight = amx_tiles.pack(linear.weight)
    num_packed = len({id(linear) for linear in linears + in_fp32})
    logger.info(
        "Packed %d linear weights for oneDNN (%.0f MB%s%s)",
        num_packed,
        (packed_bytes + fp32_bytes + tile_bytes) / 1e6,
        f", {len(in_fp32)} with fp32 copies for bf16 batches" if in_fp32 else "",
        f", {len(in_tiles)} with tile-layout copies for decode steps" if in_tiles else "",
    )
    return num_packed


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


def _packs_in_own_dtype(dtype: torch.dtype) -> bool:
    """oneDNN packs fp32 everywhere, bf16 only with AVX512-BF16 / AVX-512 BW+VL+DQ or
    AVX-NE-CONVERT (elsewhere a bf16 layer has only its fp32 copy, if any)."""
    return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _wants_fp32_copy(linear: Linear) -> bool:
    return linear.weight.dtype == torch.bfloat16 and linear.kernels.bf16_matmul_in_fp32


def _wants_tile_copy(linear: Linear) -> bool:
    kernels = linear.kernels
    return (kernels.bf16_amx_linear or kernels.bf16_dot_linear) and amx_tiles.fits(linear.weight)
