"""Faulting the CPU KV pool's pages in ahead of use: the first blocks at start-up, more on
CPU time nothing else wants.

The pool is an anonymous mapping, so its pages are mapped lazily: the first write to a block
faults them in inside a step. On a VM that fault is the host's first touch of guest
memory, ~0.4-0.75 GB/s here: W1-lite (32 prompts x 320 tokens) touches ~235 MB of fresh
blocks, W1 (64 x 384) ~565 MB, and faulting them inside its steps cost W1-lite 3.72 against
4.47 s (docs/performance.md, "The KV pool's first blocks at start-up"). Touching a whole 11 GB
pool up front would cost ~20 s of start-up instead.

So the pages are faulted in with MADV_POPULATE_WRITE, in the order a fresh pool hands out
its blocks (ascending ids): 256 KB of every layer's K and V before the next 256 KB of any.
- At start-up, once the model is loaded, the first `AT_START_BYTES` on the loading thread
  (about a second on a VM), as vLLM zeroes its whole cache before it reports ready: the first
  requests after a start then write to mapped pages.
- Then a background thread at SCHED_IDLE priority goes on to `AHEAD_BYTES` (what a busy
  first minute touches), but only while no step runs (`step_started` / `step_finished`, and
  `QUIET_S` after a step): a thread at idle priority that a step's threads preempt inside
  madvise holds the mmap lock that the step's own page faults and heap growth wait for, and
  OpenMP's spinning threads then keep it off the CPU. Beside W1-lite's steps that stalled
  single decode steps for 100-180 ms (four in one run).
The rest of a larger pool is faulted in by the steps that first use it, so an idle server
holds its model and that much of the pool, not the whole pool (5.9 GB resident for the 135M
default model when it faulted everything). MADV_POPULATE_WRITE never changes a page's
contents, so it is safe against the steps' own writes to the same blocks. Where the kernel
lacks it (Linux < 5.14) nothing is faulted in ahead and the steps fault as before; without
idle priority the thread does not run. Both parts stop short where the machine's available
memory would fall below a quarter of its RAM (at least 1 GiB): several engines in one machine
(a test suite holds a few) or a pool sized beyond the RAM that is left then cost only what
their steps use, and the page cache keeps room. PAGEDLLM_KV_PREFAULT=0 turns both off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from pagedllm.model.layers.onednn import available_memory_bytes
from pagedllm.runner.huge_pages import madvise
from pagedllm.utils import round_up

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14+
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Bytes of each tensor per madvise call. Calls of 2 MB slowed the model load running beside
# them more than calls of 256 KB did (load 2.6-2.9 s against 1.1-1.7; 0.6-0.8 alone).
CHUNK_BYTES = 256 * 1024
MIN_AVAILABLE_SHARE, MIN_AVAILABLE_BYTES = 0.25, 2**30  # left to the rest of the machine
AHEAD_BYTES = 2**30  # faulted in ahead at most; the steps fault in the rest as they use it
AT_START_BYTES = 2**29  # of those, faulted in at start-up, before the engine takes requests
QUIET_S = 0.05  # the background thread waits this long after a step before it goes on
_CHECK_MEMORY_EVERY_BYTES = 64 * 2**20  # /proc/meminfo is read once per this many bytes


def prefault_enabled() -> bool:
    return os.environ.get("PAGEDLLM_KV_PREFAULT", "1") != "0"


def block_major_ranges(
    tensors: Sequence[torch.Tensor], chunk_blocks: int
) -> Iterator[tuple[int, int]]:
    """(address, length) page ranges covering `tensors` (each [num_blocks, ...], blocks
    outermost), `chunk_blocks` blocks of every tensor before the next blocks of any. A
    tensor's ranges do not overlap: each starts where the one before it ended."""
    num_blocks = tensors[0].shape[0]
    for first in range(0, num_blocks, chunk_blocks):
        last = min(num_blocks, first + chunk_blocks)
        for tensor in tensors:
            block_bytes = tensor.nbytes // num_blocks
            start = tensor.data_ptr() + first * block_bytes
            begin = _page_down(start) if first == 0 else _page_up(start)
            end = _page_up(tensor.data_ptr() + last * block_bytes)
            if end > begin:
                yield begin, end - begin


def _page_down(address: int) -> int:
    return address // _PAGE_BYTES * _PAGE_BYTES


def _page_up(address: int) -> int:
    return round_up(address, _PAGE_BYTES)


class KVCachePrefaulter:
    """Faults in `at_start_bytes` on `start()`'s thread, then owns the background thread
    that goes on to `limit_bytes` between steps; `stop()` ends it within one madvise call.
    `populated_bytes` counts the bytes of the ranges populated so far."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        limit_bytes: int = AHEAD_BYTES,
        at_start_bytes: int = AT_START_BYTES,
    ) -> None:
        if not tensors or any(t.shape[0] != tensors[0].shape[0] for t in tensors):
            raise ValueError("KV tensors must be non-empty and share their number of blocks")
        block_bytes = max(t.nbytes // t.shape[0] for t in tensors)
        self.chunk_blocks = max(1, CHUNK_BYTES // block_bytes)
        self.limit_bytes = limit_bytes
        self.at_start_bytes = min(at_start_bytes, limit_bytes)
        self.populated_bytes = 0
        self.finished = threading.Event()  # set when the thread ends, for any reason
        self._stopping = threading.Event()
        self._ranges = block_major_ranges(list(tensors), self.chunk_blocks)
        self._floor = _memory_floor_bytes()
        self._next_check = 0
        self._steps_running = 0
        self._quiet_from = 0.0  # time.monotonic() after which no step has run for QUIET_S
        # The thread holds the tensors, so their memory outlives any call it makes.
        self._thread = threading.Thread(
            target=self._run, args=(list(tensors),), name="kv-prefault", daemon=True
        )

    def start(self) -> KVCachePrefaulter:
        started = time.perf_counter()
        if self._populate(self.at_start_bytes) and self.at_start_bytes > 0:
            logger.info(
                "KV pool: first %.2f GB faulted in at start-up in %.1f s",
                self.populated_bytes / 1e9,
                time.perf_counter() - started,
            )
        self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def step_started(self) -> None:
        self._steps_running += 1

    def step_finished(self) -> None:
        self._steps_running -= 1
        self._quiet_from = time.monotonic() + QUIET_S

    def _run(self, tensors: list[torch.Tensor]) -> None:
        try:
            if self.populated_bytes < self.limit_bytes and _lower_own_priority():
                started = time.perf_counter()
                self._populate(self.limit_bytes, between_steps=True)
                logger.debug(
                    "KV pool faulted in: %.2f GB (%.1f s in the background)",
                    self.populated_bytes / 1e9,
                    time.perf_counter() - started,
                )
        finally:
            self.finished.set()

    def _populate(self, until_bytes: int, between_steps: bool = False) -> bool:
        """Faults the next ranges in until `until_bytes` are; False where it stopped for
        good (stopped, the pool done, memory low, madvise refused)."""
        while self.populated_bytes < until_bytes:
            if between_steps and not self._wait_for_quiet():
                return False
            address_length = next(self._ranges, None)
            if address_length is None or self._stopping.is_set():
                return False
            address, length = address_length
            if self.populated_bytes >= self._next_check:
                if available_memory_bytes() < self._floor + length:
                    logger.info(
                        "KV pool: %.2f GB faulted in ahead; the rest is left to the steps "
                        "that use it (available memory is low)",
                        self.populated_bytes / 1e9,
                    )
                    self._ranges = iter(())
                    return False
                self._next_check = self.populated_bytes + _CHECK_MEMORY_EVERY_BYTES
            error = madvise(address, length, MADV_POPULATE_WRITE)
            if error:
                logger.debug("KV pool not faulted in ahead (madvise errno %d)", error)
                self._ranges = iter(())
                return False
            self.populated_bytes += length
        return True

    def _wait_for_quiet(self) -> bool:
        """Returns once no step has run for QUIET_S; False if stopped meanwhile."""
        while self._steps_running or time.monotonic() < self._quiet_from:
            if self._stopping.wait(QUIET_S):
                return False
        return True


def _memory_floor_bytes() -> int:
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        total = 0
    return max(MIN_AVAILABLE_BYTES, int(MIN_AVAILABLE_SHARE * total))


def _lower_own_priority() -> bool:
    """Put the calling thread at SCHED_IDLE (Linux scheduling policies are per thread)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as error:
        logger.debug("KV pool not faulted in ahead (no idle priority: %s)", error)
        return False
    return True
