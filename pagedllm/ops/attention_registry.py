"""The attention backends by name: which names exist, and building one.

Apart from the interface (`ops/attention.py`) so that the backends' modules import the
interface and this module imports them, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.ops.attention import AttentionBackend
from pagedllm.ops.cpu_attention import CpuAttentionBackend
from pagedllm.ops.torch_attention import TorchAttentionBackend

if TYPE_CHECKING:  # kernel_selection imports this module
    from pagedllm.ops.kernel_selection import KernelSelection

# Building a "cpu" backend loads (or first builds) the C++ extension; naming it does not.
_BACKENDS: dict[str, Callable[[KernelSelection | None], AttentionBackend]] = {
    "torch": lambda kernels: TorchAttentionBackend(),
    "cpu": lambda kernels: CpuAttentionBackend(
        amx_tiles=kernels is not None and kernels.bf16_amx_attention
    ),
}


def check_attention_backend(name: str) -> None:
    """Refuse an unknown backend name without building the backend (the server's API
    process checks the configuration but never runs the model)."""
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend {name!r} is unknown; choose one of {sorted(_BACKENDS)}"
        )


def get_attention_backend(name: str, kernels: KernelSelection | None = None) -> AttentionBackend:
    """A new backend of that name, running the kernels' choices where it has a say (the
    "cpu" backend's prefill tiles on AMX). Which name serves a model is `kernel_selection`'s
    to decide: "cpu" here needs the extension and raises RuntimeError without it."""
    check_attention_backend(name)
    return _BACKENDS[name](kernels)
