"""The structured-output backends by name, each imported only when one is built."""

from __future__ import annotations

from typing import Any

from pagedllm.structured_output.backend import StructuredOutputBackend

KNOWN_BACKENDS = ("xgrammar",)


def create_backend(
    name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
) -> StructuredOutputBackend:
    if name == "xgrammar":
        # Imported here: xgrammar is a heavy import, needed only by a constrained request.
        from pagedllm.structured_output.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(tokenizer, vocab_size, eos_token_ids)
    raise ValueError(
        f"structured output backend {name!r} is unknown; known: {', '.join(KNOWN_BACKENDS)}"
    )
