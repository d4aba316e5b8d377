"""Which of the target's layers an EAGLE-3 head reads (model/hidden_tap.py's indices): its
config's `eagle_config.eagle_aux_hidden_state_layer_ids`, else vLLM's default. Read where the
engine config is checked and where the head is built."""

from __future__ import annotations

from typing import Any


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's layers when the head's config names none: low, middle, high."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def aux_layers(head_config: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layers (hidden_tap.py's indices) an EAGLE-3 head reads: the config's
    `eagle_config.eagle_aux_hidden_state_layer_ids`, else vLLM's default."""
    eagle_config = getattr(head_config, "eagle_config", None) or {}
    layers = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    chosen = tuple(layers) if layers else default_aux_layers(num_target_layers)
    bad = [i for i in chosen if not isinstance(i, int) or not 0 <= i <= num_target_layers]
    if bad or len(set(chosen)) != len(chosen):
        raise ValueError(
            f"speculative_config: the EAGLE-3 head reads target layers {list(chosen)}, but the "
            f"target has {num_target_layers} layers (each must be distinct, in 0.."
            f"{num_target_layers}); give eagle_config.eagle_aux_hidden_state_layer_ids"
        )
    return chosen
