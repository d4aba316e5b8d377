"""The attention backends by name: which names exist, and building one.

Apart from the interface (`ops/attention.py`) so that the backends' modules import the
interface and this module imports them, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.ops.attention import AttentionBackend
from pagedllm.ops.cpu_attention import CpuAttentionBackend
from pagedllm.ops.torch_attention import TorchAttentionBackend

# Building a "cpu" backend loads (or first builds) the C++ extension; naming it does not.
# Each is built from the one option a kernel selection gives backends: `tiles`.
_BACKENDS: dict[str, Callable[[str | None], AttentionBackend]] = {
    "torch": lambda tiles: TorchAttentionBackend(),
    "cpu": lambda tiles: CpuAttentionBackend(tiles=tiles),
}


def check_attention_backend(name: str) -> None:
    """Refuse an unknown backend name without building the backend (the server's API
    process checks the configuration but never runs the model)."""
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend {name!r} is unknown; choose one of {sorted(_BACKENDS)}"
        )


def get_attention_backend(name: str, *, tiles: str | None = None) -> AttentionBackend:
    """A new backend of that name. Which name serves a model is `kernel_selection`'s to
    decide, and so is `tiles` (`KernelSelection.attention_tiles`: the engine of the "cpu"
    backend's bf16 prefill tiles and decodes, "amx" or "bf16_dots"; the torch backend has
    none). "cpu" here needs the extension and raises RuntimeError without it."""
    check_attention_backend(name)
    return _BACKENDS[name](tiles)
