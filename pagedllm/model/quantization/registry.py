"""Which quantization a checkpoint asks for, and whether pagedllm serves it.

`checkpoint_quantization` reads `quantization_config` from a model's config.json, as vLLM
does: its `quant_method` picks the method; `quantization` (the `--quantization` flag) may
name it too and must then agree. A method or scheme not served is refused at start-up, the
message naming it and listing what is served.
"""

from __future__ import annotations

from typing import Any

from pagedllm.model.quantization.awq import AWQMethod
from pagedllm.model.quantization.compressed_tensors import CompressedTensorsMethod
from pagedllm.model.quantization.fp8 import FP8Method
from pagedllm.model.quantization.gptq import GPTQMethod
from pagedllm.model.quantization.method import CheckpointMethod, as_dict

METHODS: dict[str, CheckpointMethod] = {
    method.name: method
    for method in (GPTQMethod(), AWQMethod(), CompressedTensorsMethod(), FP8Method())
}


def served_summary() -> str:
    """What is served, for refusals: every checkpoint method's served schemes."""
    checkpoint = "; ".join(f"{name}: {m.served}" for name, m in METHODS.items())
    return (
        f"served: checkpoints stored quantized as {checkpoint}; unquantized safetensors "
        "(quantization='int8' at load) and GGUF files (quantization='gguf')"
    )


def quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict, or None when it is not quantized."""
    config = getattr(hf_config, "quantization_config", None)
    return as_dict(config) if config else None


def checkpoint_quantization(hf_config: Any, requested: str | None) -> str | None:
    """The quantization the engine runs with: the checkpoint's method when it has one (a
    served scheme, agreeing with `requested`), else `requested`. Raises ValueError naming
    the method and scheme otherwise."""
    config = quantization_config(hf_config)
    if config is None:
        if requested in METHODS:
            raise ValueError(
                f"quantization={requested!r} reads a checkpoint stored quantized; this "
                "checkpoint's config.json has no quantization_config"
            )
        return requested
    name = str(config.get("quant_method") or "").lower()
    method = METHODS.get(name)
    if method is None:
        raise ValueError(
            f"model: checkpoints quantized with {name or 'an unnamed method'!r} are not "
            f"supported; {served_summary()}"
        )
    if requested is not None and requested != name:
        raise ValueError(
            f"quantization={requested!r} disagrees with the checkpoint, stored quantized with "
            f"{name!r} (its config.json's quantization_config); leave quantization unset or "
            f"give {name!r}"
        )
    why, scheme = _refusal_and_scheme(method, name, config)
    if why is not None:
        raise ValueError(f"model: {scheme} is not served ({why}); {served_summary()}")
    return name


def _refusal_and_scheme(
    method: CheckpointMethod, name: str, config: dict[str, Any]
) -> tuple[str | None, str]:
    """Why the checkpoint is not served (None when it is) and its scheme in words; a field
    a method cannot parse (a null, a word where a number goes) is a refusal too."""
    try:
        why = method.refusal(config)
        return why, (method.scheme(config) if why is not None else name)
    except (TypeError, ValueError) as error:
        return str(error), f"{name} checkpoint"
