"""`MedusaConfig`: what a Medusa head directory's config.json says, read as published.

FasterDecoding's heads name their counts `medusa_num_heads` and `medusa_num_layers` (and hold
no sizes: the base model's apply); vLLM's converted heads name them `num_heads` and
`num_hidden_layers` beside `hidden_size`, `vocab_size`, `original_lm_head` (one lm_head
for every head), `truncated_vocab_size` and `logit_scale`. Neither is a Transformers model
type, so the file is read as JSON. Read where the engine config is checked and where the
heads are built.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

# FasterDecoding's and vLLM's default depth of each head's residual blocks.
DEFAULT_NUM_LAYERS = 1


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int | None  # None: the target's (FasterDecoding's configs hold none)
    vocab_size: int | None
    truncated_vocab_size: int | None
    original_lm_head: bool
    logit_scale: float


def read_medusa_config(directory: str) -> MedusaConfig:
    """The heads' config; a ValueError naming what is missing or malformed."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"speculative_config: the Medusa head {directory!r} has no config.json")
    with open(path, encoding="utf-8") as file:
        raw: dict[str, Any] = json.load(file)
    num_heads = _first(raw, "medusa_num_heads", "num_heads")
    if num_heads is None:
        raise ValueError(
            f"speculative_config: the Medusa head {directory!r} names no head count "
            "(medusa_num_heads or num_heads in config.json)"
        )
    num_layers = _first(raw, "medusa_num_layers", "num_hidden_layers")
    num_layers = DEFAULT_NUM_LAYERS if num_layers is None else num_layers
    for name, value in (("heads", num_heads), ("layers", num_layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name == "heads"):
            raise ValueError(
                f"speculative_config: the Medusa head {directory!r} has {value!r} {name}"
            )
    return MedusaConfig(
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=raw.get("hidden_size"),
        vocab_size=raw.get("vocab_size"),
        truncated_vocab_size=raw.get("truncated_vocab_size"),
        original_lm_head=bool(raw.get("original_lm_head", False)),
        logit_scale=float(raw.get("logit_scale", 1.0)),
    )


def _first(raw: dict[str, Any], *names: str) -> Any:
    for name in names:
        if raw.get(name) is not None:
            return raw[name]
    return None
