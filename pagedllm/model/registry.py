"""Hugging Face architecture name -> model class, imported only when asked for."""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under pagedllm.model.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("mixtral", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str] | None) -> type[nn.Module]:
    for architecture in architectures or []:
        if architecture in _MODELS:
            module_name, class_name = _MODELS[architecture]
            module = importlib.import_module(f"pagedllm.model.models.{module_name}")
            return getattr(module, class_name)
    raise ValueError(
        f"architecture {architectures} is not supported; supported: "
        f"{', '.join(supported_architectures())}"
    )
