"""A fused projection a checkpoint stores whole, quantized as one layer: Phi-3's `qkv_proj`
and `gate_up_proj`, which GPTQModel, AutoAWQ and llm-compressor quantize as the modules they
are (one `qweight` / `weight_packed` / 8-bit `weight` whose output rows are q, k and v, or
gate and up, one after the other).

The engine's fused layers are built from shards (q, k, v; gate, up), so that a
tensor-parallel rank can keep its rows of each: `stored_shard_rows` says which rows of the
stored layer each shard is, and the packed and 8-bit swaps (`packed_swap.py`,
`w8a8_swap.py`) cut them out before taking this rank's share, as they do for separately
quantized parts. One rank ends with the stored layer's rows in their stored order (a packed
layer whose shards share an input order is one kernel layer again).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from pagedllm.model.layers.linear import Linear, MergedLinear
from pagedllm.model.layers.parallel_linear import ColumnParallelLinear


def full_rows(module: Linear) -> dict[str | None, int]:
    """Each shard's output rows in a checkpoint (before any rank takes its share)."""
    if isinstance(module, MergedLinear):
        sources = getattr(module, "shard_sources", None)
        return {
            shard: sources[shard][1] if sources else piece.stop - piece.start
            for shard, piece in module.shard_slices.items()
        }
    rows = module.weight.shape[0]
    return {None: rows * module.tp_size if isinstance(module, ColumnParallelLinear) else rows}


def is_stored_whole(module: nn.Module, parts: Mapping[str | None, Any]) -> bool:
    """Whether the checkpoint quantizes fused `module` as one layer (its parts: {None: ...})."""
    return isinstance(module, MergedLinear) and set(parts) == {None}


def stored_shard_rows(module: MergedLinear, stored_rows: int, layer: str) -> dict[str, range]:
    """Shard id -> its output rows in the stored whole layer of `stored_rows` rows; a layer
    whose rows are not the shards' (a config of other heads or sizes) is refused, `layer`
    naming it."""
    rows = full_rows(module)
    expected = sum(rows.values())
    if stored_rows != expected:
        shards = ", ".join(f"{shard} {count}" for shard, count in rows.items())
        raise ValueError(
            f"{layer} stores {stored_rows} output rows; the config's fused projection has "
            f"{expected} ({shards})"
        )
    spans: dict[str, range] = {}
    start = 0
    for shard, count in rows.items():
        assert shard is not None  # a MergedLinear's shards are named
        spans[shard] = range(start, start + count)
        start += count
    return spans
