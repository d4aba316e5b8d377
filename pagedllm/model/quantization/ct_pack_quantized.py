"""compressed-tensors `pack-quantized` config groups (llm-compressor's W4A16 / W8A16):
which are served, and which group's scheme a layer has.

Served: integer weights of 4 or 8 bits, `strategy` "group" (32 * 2^n inputs a scale) or
"channel", symmetric or not, with or without activation order (`actorder`, a
`weight_g_idx` per layer), activations unquantized (A16). 8-bit weights are served
exactly: q + 128 is the kernel's unsigned 8-bit q (its Q8_0 layout) and the zero point
goes into the min. Refused by name: other bit widths, float weights, the tensor / block /
tensor-group strategies, dynamic weight scales, quantized activations.

A layer's group is the one whose `targets` match its checkpoint name best, ranked as
compressed-tensors ranks them whatever the groups' order: the name itself, then "re:" and a
regular expression (matched from the start), then the class name "Linear" (every quantized
layer here is a linear layer). Two groups of different schemes matching at the same rank
are refused, not guessed between. `ignore`d layers are stored unquantized, so the reader
never sees them as packed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagedllm.model.quantization.gptq import PER_CHANNEL, is_served_group_size

PACK_QUANTIZED = "pack-quantized"
SERVED = (
    "pack-quantized W4A16 / W8A16 (int weights, strategy group of 32 * 2^n or channel, "
    "symmetric or not, actorder either way), ignored layers unquantized"
)
SERVED_BITS = (4, 8)
SERVED_STRATEGIES = ("group", "channel")
LINEAR_CLASS = "Linear"


@dataclass(frozen=True)
class PackedScheme:
    """One config group's weight scheme."""

    bits: int
    group_size: int  # -1: one scale per output channel
    symmetric: bool


def group_refusal(group: dict[str, Any]) -> str | None:
    """Why a pack-quantized config group is not served, or None."""
    weights = group.get("weights") or {}
    activations = group.get("input_activations")
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    if activations and int(activations.get("num_bits", 16)) < 16:
        return f"activations quantized to {activations['num_bits']} bits are not served"
    if group.get("output_activations"):
        return "quantized output activations are not served"
    if weights.get("type", "int") != "int":
        return f"{weights.get('type')} weights are not packed integers"
    if bits not in SERVED_BITS:
        return f"{bits}-bit weights have no kernel yet (4 and 8 bits do)"
    if strategy not in SERVED_STRATEGIES:
        return f"weight strategy {strategy!r} is not served (group and channel are)"
    if weights.get("dynamic"):
        return "dynamic weight scales are not served"
    group_size = weights.get("group_size")
    if strategy == "group" and not (group_size and is_served_group_size(int(group_size))):
        return f"group size {group_size} is not 32 * 2^n"
    return None


def packed_scheme(group: dict[str, Any]) -> PackedScheme:
    weights = group["weights"]
    group_size = int(weights["group_size"]) if weights["strategy"] == "group" else PER_CHANNEL
    return PackedScheme(int(weights["num_bits"]), group_size, bool(weights.get("symmetric", True)))


def match_rank(name: str, target: str) -> int | None:
    """How closely `target` names the layer `name` (0: its name, 1: a regex, 2: the
    class), or None when it does not."""
    if target.startswith("re:"):
        return 1 if re.match(target.removeprefix("re:"), name) is not None else None
    if target == name:
        return 0
    return 2 if target == LINEAR_CLASS else None


def _group_rank(group: dict[str, Any], layer: str) -> int | None:
    ranks = [match_rank(layer, target) for target in group.get("targets") or ()]
    return min((rank for rank in ranks if rank is not None), default=None)


def _best_groups(config: dict[str, Any], layer: str) -> dict[str, dict[str, Any]]:
    """The groups matching `layer` at the closest rank any group reaches."""
    ranked = {
        name: (rank, group)
        for name, group in (config.get("config_groups") or {}).items()
        if (rank := _group_rank(group, layer)) is not None
    }
    best = min((rank for rank, _ in ranked.values()), default=None)
    return {name: group for name, (rank, group) in ranked.items() if rank == best}


def is_quantized_layer(config: dict[str, Any], layer: str) -> bool:
    """Whether a checkpoint of `config` stores `layer` packed: some config group targets it
    and `ignore` does not name it (a name, a "re:" pattern or the class, as targets)."""
    ignored = any(match_rank(layer, target) is not None for target in config.get("ignore") or ())
    return not ignored and bool(_best_groups(config, layer))


def has_group_actorder(config: dict[str, Any], layer: str) -> bool:
    """Whether `layer`'s group orders its inputs by activation in groups ("group", or the
    older `true`): its layers then store a `weight_g_idx`."""
    return any(
        (group.get("weights") or {}).get("actorder") in ("group", True)
        for group in _best_groups(config, layer).values()
    )


def layer_scheme(config: dict[str, Any], layer: str) -> PackedScheme:
    """The scheme of the packed layer `layer` (its checkpoint name, without `.weight`)."""
    groups = _best_groups(config, layer)
    if not groups:
        raise ValueError(f"compressed-tensors layer {layer!r} matches no config group's targets")
    for name, group in groups.items():
        if group_refusal(group) is not None:  # refused at start-up; a guard
            raise ValueError(f"config group {name!r} of {layer!r} is not served")
    schemes = {packed_scheme(group) for group in groups.values()}
    if len(schemes) > 1:
        raise ValueError(
            f"compressed-tensors layer {layer!r} matches config groups "
            f"{', '.join(map(repr, groups))} alike, with different schemes"
        )
    return schemes.pop()
