"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """An adapter by name, a positive id unique to its weights, and the directory of its
    PEFT files (`adapter_config.json` and `adapter_model.safetensors` or `.bin`).

    The id is the adapter's identity in the engine: requests with equal ids share the
    resident weights and their cached KV, so one id must always mean one set of weights.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request: lora_name must be a non-empty string")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or not 1 <= self.lora_int_id < 2**63
        ):
            raise ValueError(
                f"lora_request: lora_int_id must be an integer in [1, 2**63), "
                f"got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_request: lora_path must name the adapter's directory")

    @property
    def cache_key(self) -> tuple[str, int, str]:
        """What the prefix cache keys an adapter's KV by: two adapters never share KV."""
        return ("lora", self.lora_int_id, self.lora_name)
