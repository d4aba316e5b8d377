"""The benchmarks' shared timer: median wall time of a call after one warm-up call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    call()  # warm-up: page faults, buffers, lazily built kernels
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)
