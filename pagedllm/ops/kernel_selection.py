"""Which implementation runs each kernel family, decided once per engine.

The decision (`select_kernels`) reads the device, the model and KV cache dtypes, the head
size, the requested attention backend and what the CPU offers (AVX2 + FMA, and whether the
C++ extension builds and loads), and returns a `KernelSelection`. The model runner makes it
when it loads the model and hands the same object to the model (its layers keep it) and to
the sampler; `ops/fused.py` reads it on every call instead of a flag of its own. Each kernel
keeps its torch reference, which runs wherever the selection says no: other devices (any,
not only CUDA), CPUs without AVX2, models neither fp32 nor bf16 for the fused ops, and
`attention_backend="torch"`, which asks for the torch references throughout.

The GGUF kernel's path (AVX-512 VNNI, AVX2, portable) is not part of this decision: each
`GGUFLinear` takes the widest one `cpu_features` allows. The features are logged once, with
the first selection.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from pagedllm.ops import extension
from pagedllm.ops.attention_registry import check_attention_backend
from pagedllm.ops.cpu_attention import kernel_covers
from pagedllm.ops.cpu_features import cpu_features, describe_cpu, kernel_isa_missing

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelSelection:
    """The implementations one engine runs (frozen: a compiled graph may guard on it)."""

    attention: str  # the attention backend's name: "cpu" (C++ kernel) or "torch"
    # The C++ RMSNorm, SiLU·up and RoPE (fp32 and bf16 tensors on the CPU) and few-row
    # linear (fp32).
    fused_ops: bool
    # The C++ plain draw of the sampler and its greedy pick (fp32 logits on the CPU: the
    # sampler upcasts them).
    sampler_draw: bool
    # A bf16 model's linear layers multiply batches of many rows in fp32, on an fp32 copy of
    # their weights (exact: bf16 products are fp32 numbers), where the CPU's bf16 matmuls
    # are slower than fp32's (`fused.BF16_IN_FP32_MIN_ROWS`).
    bf16_matmul_in_fp32: bool = False
    # A bf16 model's linear layers multiply the few rows of decode steps on AMX tiles
    # (`fused.AMX_MAX_ROWS`), where the CPU has AMX-BF16 and the kernel grants its tile data.
    bf16_amx_linear: bool = False
    # Without AMX, where AVX512-BF16 dot products run at least at the fp32 FMA rate (AMD Zen
    # 4/5), those rows run in one pass of `vdpbf16ps` over the same tile-layout copy
    # (`fused.BF16_DOT_MAX_ROWS`, ops/csrc/bf16_dot_linear.cpp).
    bf16_dot_linear: bool = False
    # A bf16 KV cache's attention (prefill tiles and decodes) runs on AMX tiles
    # (ops/csrc/attention_amx.h), under the same condition.
    bf16_amx_attention: bool = False
    # Or, under bf16_dot_linear's condition, its prefill tiles on AVX512-BF16 dot products
    # doing the tiles' work (ops/csrc/attention_dots.h), and its decodes (decode_dots.h).
    bf16_dot_attention: bool = False

    @property
    def attention_tiles(self) -> str | None:
        """The engine the attention backend's tiles run on (`CpuAttentionBackend`)."""
        if self.bf16_amx_attention:
            return "amx"
        return "bf16_dots" if self.bf16_dot_attention else None

    def describe(self) -> str:
        def which(kernel: bool) -> str:
            return "C++" if kernel else "torch"

        matmul = ", bf16 matmuls in fp32" if self.bf16_matmul_in_fp32 else ""
        amx = ", bf16 decode matmuls on AMX" if self.bf16_amx_linear else ""
        amx += ", bf16 decode matmuls on AVX512-BF16 dot products" if self.bf16_dot_linear else ""
        amx += ", bf16 attention on AMX" if self.bf16_amx_attention else ""
        amx += ", bf16 attention on AVX512-BF16 dot products" if self.bf16_dot_attention else ""
        return (
            f"attention={self.attention}, fused ops={which(self.fused_ops)}, "
            f"sampler draw={which(self.sampler_draw)}{matmul}{amx}"
        )


# The torch references everywhere: any device, any dtype.
TORCH_KERNELS = KernelSelection(attention="torch", fused_ops=False, sampler_draw=False)

_unavailable_logged = False
_features_logged = False


def select_kernels(
    device: torch.device | str,
    dtype: torch.dtype,
    attention_backend: str,
    *,
    head_dim: int,
    cache_dtype: torch.dtype,
) -> KernelSelection:
    """The implementations for a model of `dtype` and `head_dim` whose KV cache is in
    `cache_dtype`, on `device`, when `attention_backend` was asked for.

    The C++ kernels all come from one extension and serve only the CPU; "torch" asks for
    the references everywhere. With "cpu" on the CPU: the attention kernel where it covers
    the head size and cache dtype, the fused ops for fp32 and bf16 models, the sampler's draw
    always.
    Where the extension cannot load (no AVX2/FMA, no compiler) the references run and the
    reason is logged once per process, as an error.
    """
    check_attention_backend(attention_backend)
    if attention_backend == "torch" or torch.device(device).type != "cpu":
        return TORCH_KERNELS
    _log_features()
    unavailable = kernel_isa_missing() or _extension_error()
    if unavailable is not None:
        _log_unavailable(unavailable)
        return TORCH_KERNELS
    return KernelSelection(
        attention="cpu" if kernel_covers(head_dim, cache_dtype) else "torch",
        fused_ops=dtype in (torch.float32, torch.bfloat16),
        sampler_draw=True,
        bf16_matmul_in_fp32=dtype == torch.bfloat16 and not bf16_matmul_native(),
        bf16_amx_linear=dtype == torch.bfloat16 and amx_tiles_granted(),
        bf16_dot_linear=dtype == torch.bfloat16 and _bf16_dots_win(),
        bf16_amx_attention=dtype == cache_dtype == torch.bfloat16 and amx_tiles_granted(),
        bf16_dot_attention=dtype == cache_dtype == torch.bfloat16 and _bf16_dots_win(),
    )


# vdpbf16ps must do at least an fp32 FMA's work a cycle for oneDNN's bf16 matmuls to win:
# twice it on AMD Zen 4, half of it on Intel cores without AMX (ops/csrc/cpu_probe.cpp).
BF16_DOT_MIN_SPEED_RATIO = 1.0


@functools.cache
def bf16_matmul_native() -> bool:
    """Whether oneDNN's bf16 matmuls beat fp32 ones on this CPU: AMX tiles, or AVX512-BF16
    dot products measured at least as fast as fp32 FMAs (a register loop of ~5 ms, once a
    process). Elsewhere bf16 products are converted to fp32 (no AVX512-BF16) or issue at
    half the FMA rate, and a bf16 model's linear layers multiply in fp32 instead."""
    features = cpu_features()
    if features.amx_bf16:
        return True
    if not features.avx512_bf16:
        return False
    ratio = float(extension.load().bf16_dot_speed_ratio())
    logger.info("bf16 dot products run at %.2fx the fp32 FMA rate on this CPU", ratio)
    return ratio >= BF16_DOT_MIN_SPEED_RATIO


def _bf16_dots_win() -> bool:
    """The dot-product kernel where it is meant to beat oneDNN's few-row calls: no AMX
    tiles (they win), and dot products at least as fast as fp32 FMAs (AMD Zen 4/5)."""
    return not amx_tiles_granted() and bf16_dot_granted() and bf16_matmul_native()


def bf16_dot_granted() -> bool:
    """Whether the CPU has AVX512-BF16 and AVX-512 BW, neither hidden."""
    features = cpu_features()
    return features.avx512_bf16 and features.avx512bw


@functools.cache
def amx_tiles_granted() -> bool:
    """Whether the CPU has AMX-BF16 and AVX512-BF16 (the kernel rounds its sums with it),
    neither hidden, and Linux lets this process use the tiles."""
    features = cpu_features()
    return (
        features.amx_bf16
        and features.avx512_bf16
        and features.avx512bw
        and bool(extension.load().amx_available())
    )


def _extension_error() -> str | None:
    try:
        extension.load()
    except RuntimeError as error:
        return str(error)
    return None


def _log_features() -> None:
    global _features_logged
    if not _features_logged:
        logger.info("%s", describe_cpu())
        _features_logged = True


def _log_unavailable(reason: str) -> None:
    global _unavailable_logged
    if not _unavailable_logged:
        logger.error("%s; falling back to the torch kernels (attention_backend='torch')", reason)
        _unavailable_logged = True
