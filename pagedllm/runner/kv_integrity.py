"""The debug-mode KV integrity check: one rank's KV state against the scheduler's.

With `PAGEDLLM_DEBUG=1` a step's `SchedulerOutput.kv_check` carries the scheduler's block
table of every running request; once the step's updates are applied, before the forward,
every rank checks its KV tensors' shape and its own tables against it and raises
`KVIntegrityError` naming itself on any difference. This module owns that comparison; the
runner supplies its batch, its KV tensors and the shape its heads and stage imply.
"""

from __future__ import annotations

import torch

from pagedllm.core.scheduler_output import KVTableCheck
from pagedllm.ops.kv_quant import kv_cache_layout
from pagedllm.runner.input_batch import InputBatch

# Problems a failed KV integrity check lists before it says how many more there are.
MAX_REPORTED_PROBLEMS = 5
# What each KV cache entry holds: K and V, and a quantized cache's scales.
_ENTRY_NAMES = ("K", "V", "K scale", "V scale")


class KVIntegrityError(AssertionError):
    """A rank's KV state disagrees with the scheduler's (debug mode): a bug, never a
    request's fault, so it ends the engine. The message names the rank."""


def check_kv_integrity(
    expected: KVTableCheck,
    batch: InputBatch,
    kv_caches: list[tuple[torch.Tensor, ...]],
    layers: range,
    layer_shape: tuple[int, int, int, int],
    cache_dtype: torch.dtype,
    rank_name: str,
) -> None:
    """Raise `KVIntegrityError` naming `rank_name` unless `kv_caches` (one entry per layer
    of `layers`) have `layer_shape` and `cache_dtype`'s layout, and `batch`'s block table of
    every running request equals the scheduler's, with no block the null block or outside
    the pool."""
    problems = _shape_problems(kv_caches, layers, layer_shape, cache_dtype)
    for request_id, want in expected.block_tables.items():
        problems += _table_problems(expected, batch, request_id, want)
    if problems:
        more = len(problems) - MAX_REPORTED_PROBLEMS
        raise KVIntegrityError(
            f"KV integrity check failed on {rank_name}: "
            + "; ".join(problems[:MAX_REPORTED_PROBLEMS])
            + (f"; and {more} more" if more > 0 else "")
        )


def _table_problems(
    expected: KVTableCheck, batch: InputBatch, request_id: str, want: list[int]
) -> list[str]:
    row = batch.req_id_to_row.get(request_id)
    if row is None:
        return [f"no row for running request {request_id!r}"]
    got = batch.block_table[row, : batch.num_blocks[row]].tolist()
    # A block a window has freed is the null block in the scheduler's table; the runner
    # keeps the old id there, which no kernel reads.
    null = expected.null_block_id
    got = [w if w == null else g for g, w in zip(got, want, strict=False)] + got[len(want) :]
    problems = []
    if got != want:
        problems.append(f"request {request_id!r}: block table {got} != the scheduler's {want}")
    wrong = [
        b
        for b, w in zip(got, want, strict=False)
        if (b == null and w != null) or not 0 <= b < expected.num_blocks
    ]
    if wrong:
        problems.append(
            f"request {request_id!r}: block(s) {wrong} are the null block "
            f"({expected.null_block_id}) or outside the pool of {expected.num_blocks}"
        )
    return problems


def _shape_problems(
    kv_caches: list[tuple[torch.Tensor, ...]],
    layers: range,
    layer_shape: tuple[int, int, int, int],
    cache_dtype: torch.dtype,
) -> list[str]:
    if len(kv_caches) != len(layers):
        return [
            f"{len(kv_caches)} layers of KV cache for the {len(layers)} "
            f"layers of its stage ({layers.start}-{layers.stop - 1})"
        ]
    expected = list(zip(_ENTRY_NAMES, kv_cache_layout(layer_shape, cache_dtype), strict=False))
    problems = []
    for layer, entry in zip(layers, kv_caches, strict=True):
        if len(entry) != len(expected):
            problems.append(f"layer {layer} has {len(entry)} KV tensors, not {len(expected)}")
            continue
        for (name, (want_shape, want_dtype)), tensor in zip(expected, entry, strict=True):
            if tuple(tensor.shape) != want_shape or tensor.dtype != want_dtype:
                problems.append(
                    f"layer {layer}'s {name} cache is {tuple(tensor.shape)} {tensor.dtype}, "
                    f"not {want_shape} {want_dtype}"
                )
    return problems
