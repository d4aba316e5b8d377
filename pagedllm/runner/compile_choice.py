"""Whether decode steps run compiled when the user left it to the engine (`compile=None`).

Compiled wherever the graph is tested bit-equal to the eager step, as vLLM compiles unless
told `--enforce-eager`: one rank, the CPU attention kernel, float32 compute on plain or
GGUF-quantized weights (every architecture: tests/engine/test_compiled_decode.py,
tests/model/test_gguf_architectures.py), and a C++ compiler for Inductor's code. Elsewhere
the step stays eager and the log says why, once. `compile=True` still asks for it anywhere
it traces; `PAGEDLLM_COMPILE=0` leaves the default eager (the test suite sets it, so that
only the tests about compiling pay for it).
"""

from __future__ import annotations

import os
from functools import cache
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

# Quantizations whose compiled step is tested bit-equal to the eager one (None: plain weights).
EXACT_QUANTIZATIONS = (None, "gguf")


def eager_reason(config: EngineConfig, traceable: bool) -> str | None:
    """Why `compile=None` leaves this engine's decode steps eager; None: compile them.
    `traceable`: the attention backend reads a step's layout from tensors."""
    model_config = config.model_config
    reasons = (
        (os.environ.get("PAGEDLLM_COMPILE") == "0", "PAGEDLLM_COMPILE=0"),
        (
            torch.device(config.device).type != "cpu",
            f"device={config.device!r} (the compiled step is built and tested on the CPU)",
        ),
        (config.parallel_config.world_size > 1, "several ranks (a graph traces no collectives)"),
        (config.pooler_config is not None, "the pooling runner runs prefill steps only"),
        (
            config.speculative_config is not None,
            "speculative decoding (its steps verify several tokens a request)",
        ),
        (not traceable, f"attention_backend={config.attention_backend!r} (compiles with 'cpu')"),
        (
            model_config.dtype != torch.float32,
            f"dtype {model_config.dtype} (a graph rounds 16-bit element-wise chains once, eager "
            "at every op)",
        ),
        (
            model_config.quantization not in EXACT_QUANTIZATIONS,
            f"quantization={model_config.quantization!r} (not tested bit-equal compiled)",
        ),
    )
    why = next((why for refused, why in reasons if refused), None)
    if why is None and not has_cpp_compiler():
        return "no C++ compiler for Inductor's code"
    return why


@cache
def has_cpp_compiler() -> bool:
    """Inductor's CPU code is C++ built at start-up: without a compiler (a wheel installed
    on a bare machine) the compile would fail after tracing the whole model."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception:  # torch raises its own error type when the search finds nothing
        return False
    return True
