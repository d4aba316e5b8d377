"""An engine core's memory outside its KV pool, for the soak's comparison across cores.

The pool's pages are faulted in as blocks are first used (and ahead of use on idle CPU), so
a core's RSS at a given age varies by hundreds of MB with how much of the pool it touched
(2.57-3.07 GB across one soak's cores, no trend), and so do the host tier's buffers as
blocks are offloaded. What a leak would grow is the rest. The core publishes the address
ranges of both when PAGEDLLM_KV_POOL_RANGES_DIR is set (pagedllm/runner/kv_pool_ranges.py);
their resident bytes are the pages of those ranges present in /proc/<pid>/pagemap (bit 63
of each page's 64-bit entry), and the RSS outside the pool is the RSS less them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import psutil

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
PRESENT_BIT = 1 << 63
ENTRY_BYTES = 8
RSS_OUTSIDE_POOL_DEFINITION = (
    "RSS less the KV pool's resident bytes: the pages of the pool tensors' address ranges "
    "(published by the core in PAGEDLLM_KV_POOL_RANGES_DIR/<pid>.json) that "
    "/proc/<pid>/pagemap marks present"
)


def read_ranges(ranges_dir: Path, pid: int) -> list[tuple[int, int]] | None:
    """The pool's [start, bytes] ranges the core `pid` published; None before it did."""
    try:
        published = json.loads((ranges_dir / f"{pid}.json").read_text())
    except FileNotFoundError:
        return None
    return [(start, size) for start, size in published]


def resident_bytes(pid: int, ranges: list[tuple[int, int]]) -> int:
    """Bytes of the pages overlapping `ranges` that are in memory in process `pid` (pages
    two ranges share count once)."""
    present = 0
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for first, count in _page_runs(ranges):
            pagemap.seek(first * ENTRY_BYTES)
            entries = np.frombuffer(pagemap.read(count * ENTRY_BYTES), dtype=np.uint64)
            present += int(np.count_nonzero(entries & np.uint64(PRESENT_BIT)))
    return present * PAGE_BYTES


def _page_runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pages `ranges` overlap as (first page, count) runs, merged where they touch or
    overlap (two tensors may share a page): one read each, no page counted twice."""
    runs: list[tuple[int, int]] = []
    for start, size in sorted(ranges):
        first, end = start // PAGE_BYTES, (start + size - 1) // PAGE_BYTES + 1
        if runs and first <= runs[-1][0] + runs[-1][1]:
            run_first = runs[-1][0]
            runs[-1] = (run_first, max(runs[-1][1], end - run_first))
        else:
            runs.append((first, end - first))
    return runs


def core_usage(process: psutil.Process, ranges_dir: Path) -> dict[str, int | None]:
    """RSS, RSS outside the KV pool (None until the core published its pool) and open fds."""
    rss = process.memory_info().rss
    ranges = read_ranges(ranges_dir, process.pid)
    outside = None if ranges is None else rss - resident_bytes(process.pid, ranges)
    return {"rss": rss, "rss_outside_kv_pool": outside, "open_fds": process.num_fds()}
