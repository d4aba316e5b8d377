"""`LoRAConfig`: how many adapters the engine holds, and how large they may be."""

from __future__ import annotations

from dataclasses import dataclass

# The largest rank an engine may be configured for (vLLM's largest choice).
MAX_SUPPORTED_RANK = 512


@dataclass(frozen=True)
class LoRAConfig:
    """`max_loras` adapters can run in one step (each holds a slot of stacked weights in
    every LoRA layer); `max_cpu_loras` stay loaded in memory, least recently used dropped
    beyond it (never one a live request uses); `max_lora_rank` bounds an adapter's rank and
    sizes the slots."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_lora_rank > MAX_SUPPORTED_RANK:
            raise ValueError(
                f"max_lora_rank must be at most {MAX_SUPPORTED_RANK}, got {self.max_lora_rank}"
            )
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif (
            not isinstance(self.max_cpu_loras, int)
            or isinstance(self.max_cpu_loras, bool)
            or self.max_cpu_loras < self.max_loras
        ):
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                f"got {self.max_cpu_loras!r}"
            )


# Architectures whose decoder layers carry LoRA layers (Llama-style q/k/v/o and gate/up/down
# projections); tested against PEFT on Llama and Qwen2.
LORA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
