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
# Each is built from the one option a kernel selection gives backends: `amx_tiles`.
_BACKENDS: dict[str, Callable[[bool], AttentionBackend]] = {
    "torch": lambda amx_tiles: TorchAttentionBackend(),
    "cpu": lambda amx_tiles: CpuAttentionBackend(amx_tiles=amx_tiles),
}


def check_attention_backend(name: str) -> None:
    """Refuse an unknown backend name without building the backend (the server's API
    process checks the configuration but never runs the model)."""
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend {name!r} is unknown; choose one of {sorted(_BACKENDS)}"
        )


def get_attention_backend(name: str, *, amx_tiles: bool = False) -> AttentionBackend:
    """A new backend of that name. Which name serves a model is `kernel_selection`'s to
    decide, and so is `amx_tiles` (`KernelSelection.bf16_amx_attention`: the "cpu"
    backend's bf16 prefill tiles and decodes on AMX; the torch backend has none). "cpu"
    here needs the extension and raises RuntimeError without it."""
    check_attention_backend(name)
    return _BACKENDS[name](amx_tiles)
