"""LoRA's scheduler side: at most `max_loras` adapters run in one step (the base model takes
no slot), and how many requests run each adapter (for the metrics). None: LoRA is off."""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.request import Request


class LoRASlots:
    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras

    def fits(self, request: Request, step_loras: set[int]) -> bool:
        """Whether the request's adapter can run in a step already running `step_loras`."""
        lora_id = request.lora_int_id
        if not lora_id or lora_id in step_loras or self.max_loras is None:
            return True
        return len(step_loras - {0}) < self.max_loras

    def counts(self, requests: Iterable[Request]) -> dict[str, int] | None:
        """Adapter name -> how many of `requests` run it (None when LoRA is off)."""
        if self.max_loras is None:
            return None
        counts: dict[str, int] = {}
        for request in requests:
            if request.lora_request is not None:
                name = request.lora_request.lora_name
                counts[name] = counts.get(name, 0) + 1
        return counts
