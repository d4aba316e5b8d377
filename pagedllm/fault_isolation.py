"""`isolate_row_faults`: run a batch of per-request work; when it raises, find the rows at fault.

The engine runs each request's own stages batched: the scheduler fills the step's grammar
bitmask, the runner applies logits processors and the bitmask. An exception there may be
one request's doing (its grammar, its parameters) or the engine's. Running each row alone
tells which: the rows that raise alone fail on their own, the rest run batched again, and
since each stage works row by row they get exactly what they would have had. An error that
no single row reproduces belongs to no request, so it raises.

A leaf module (it imports nothing of the package), so the core and the worker layers share it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

Row = TypeVar("Row")
Result = TypeVar("Result")


def isolate_row_faults(
    run: Callable[[list[Row]], Result],
    rows: Sequence[Row],
    on_fault: Callable[[Row, Exception], None],
) -> tuple[Result, list[Row]]:
    """`run(rows)`; when it raises, `run([row])` for each row, `on_fault(row, error)` for each
    that raises alone, then `run(healthy rows)` (even when none is left).

    Returns the result of the last run and the rows it ran. Re-raises the batch's error when
    every row runs alone without raising."""
    batch = list(rows)
    try:
        return run(batch), batch
    except Exception:
        healthy = [row for row in batch if _runs_alone(run, row, on_fault)]
        if len(healthy) == len(batch):
            raise
    return run(healthy), healthy


def _runs_alone(
    run: Callable[[list[Row]], object], row: Row, on_fault: Callable[[Row, Exception], None]
) -> bool:
    try:
        run([row])
    except Exception as error:
        on_fault(row, error)
        return False
    return True
