"""Which implementation runs each kernel family, decided once per engine.

The decision (`select_kernels`) reads the device, the model and KV cache dtypes, the head
size, the requested attention backend and what the CPU offers (AVX2 + FMA, and whether the
C++ extension builds and loads), and returns a `KernelSelection`. The model runner makes it
when it loads the model and hands the same object to the model (its layers keep it) and to
the sampler; `ops/fused.py` reads it on every call instead of a flag of its own. Each kernel
keeps its torch reference, which runs wherever the selection says no: other devices (any,
not only CUDA), CPUs without AVX2, non-fp32 models for the fused ops, and
`attention_backend="torch"`, which asks for the torch references throughout.

The GGUF kernel's path (AVX-512 VNNI, AVX2, portable) is not part of this decision: each
`GGUFLinear` takes the widest one `cpu_features` allows. The features are logged once, with
the first selection.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedllm.ops import extension
from pagedllm.ops.attention_registry import check_attention_backend
from pagedllm.ops.cpu_attention import kernel_covers
from pagedllm.ops.cpu_features import describe_cpu, kernel_isa_missing

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelSelection:
    """The implementations one engine runs (frozen: a compiled graph may guard on it)."""

    attention: str  # the attention backend's name: "cpu" (C++ kernel) or "torch"
    # The C++ RMSNorm, SiLU·up, RoPE and few-row linear (fp32 tensors on the CPU).
    fused_ops: bool
    # The C++ plain draw of the sampler (fp32 logits on the CPU: the sampler upcasts them).
    sampler_draw: bool

    def describe(self) -> str:
        def which(kernel: bool) -> str:
            return "C++" if kernel else "torch"

        return (
            f"attention={self.attention}, fused ops={which(self.fused_ops)}, "
            f"sampler draw={which(self.sampler_draw)}"
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
    the head size and cache dtype, the fused ops for fp32 models, the sampler's draw always.
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
        fused_ops=dtype == torch.float32,
        sampler_draw=True,
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
