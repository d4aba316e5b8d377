"""All-reduce between the ranks of one host through shared memory (the CPU tensor-parallel path).

gloo's all-reduce between processes of one host still goes through loopback TCP: a decode
step's 64 x hidden tensor pays two socket round trips per layer. Here every rank writes its
tensor into its own slot of one shared segment, raises its sequence counter, waits for the
others' counters, and sums every slot itself, in rank order 0, 1, ..., n-1, so each rank gets
bitwise the same result whatever the timing (the same adds on the same bits), and the result
is the plain left-to-right sum.

Layout of the segment: one 64-byte line per rank and counter (no false sharing between
ranks), two counters per rank (`written`: the last operation whose data it has put in its
slot; `read`: the last operation whose slots it has finished summing), then two banks of
one slot per rank. Operation `seq` uses bank `seq % 2`, so a rank may write operation
`seq + 1` while a slower rank still reads `seq`; it waits only until every rank has read
operation `seq - 1` from the bank it is about to overwrite. Tensors larger than a slot go
through in slot-sized chunks, one operation each.

Ordering: counters are written after the data and read before it. x86 keeps stores in
program order and loads in program order (TSO), which is all this protocol needs; other
architectures would need fences, so the group uses this path only on x86-64 (see
`shm_allreduce_supported`).

Waiting spins briefly, then yields the core (ranks may share cores), and raises
`TimeoutError` naming the ranks that did not arrive after `timeout_s`, so a dead peer
ends the step instead of hanging it.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

_LINE = 64  # bytes per counter: one cache line each
# Per rank and bank: a decode step's 64 x 4096 fp32 tensor (1 MiB) fits 4 times over; a
# prefill chunk larger than this goes through in several operations.
DEFAULT_SLOT_BYTES = 4 * 2**20
# Spins before the wait starts yielding the core, and between deadline checks.
_SPIN = 256
_CHECK_EVERY = 1024
DISABLE_ENV = "PAGEDLLM_SHM_ALLREDUCE"  # "0": the TP group uses gloo's all-reduce


def shm_allreduce_supported() -> bool:
    """x86-64 Linux (the ordering argument above), not turned off by PAGEDLLM_SHM_ALLREDUCE=0."""
    return (
        os.environ.get(DISABLE_ENV, "1") != "0"
        and platform.system() == "Linux"
        and platform.machine() in ("x86_64", "AMD64")
    )


def segment_bytes(world_size: int, slot_bytes: int) -> int:
    return 2 * world_size * _LINE + 2 * world_size * slot_bytes


class ShmAllReduce:
    """One group's shared segment; every rank of the group holds one, attached by name.

    `create` (the group's rank 0) and `attach` (the others) build it; `all_reduce` must be
    called by every rank with tensors of the same shape and dtype, in the same order.
    """

    def __init__(
        self,
        shm: shared_memory.SharedMemory,
        world_size: int,
        rank: int,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        timeout_s: float = 60.0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        self._shm = shm
        self.world_size, self.rank = world_size, rank
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.seq = 0
        raw = np.ndarray((segment_bytes(world_size, slot_bytes),), np.uint8, shm.buf)
        counters = raw[: 2 * world_size * _LINE].view(np.int64)
        step = _LINE // 8
        self._written = counters[: world_size * step : step]
        self._read = counters[world_size * step :: step]
        data = torch.from_numpy(raw[2 * world_size * _LINE :])
        self._slots = data.view(2, world_size, slot_bytes)

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def create(cls, world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES, **kwargs):
        """Rank 0's segment (zeroed counters); pass `.name` to the others."""
        shm = shared_memory.SharedMemory(create=True, size=segment_bytes(world_size, slot_bytes))
        shm.buf[: 2 * world_size * _LINE] = bytes(2 * world_size * _LINE)
        return cls(shm, world_size, 0, slot_bytes, **kwargs)

    @classmethod
    def attach(cls, name: str, world_size: int, rank: int, **kwargs) -> ShmAllReduce:
        return cls(_attach_untracked(name), world_size, rank, **kwargs)

    @property
    def name(self) -> str:
        return self._shm.name

    def unlink(self) -> None:
        """Drop the name (rank 0, once every rank has attached): the segment lives on until
        the last rank closes it, and nothing is left in /dev/shm if a rank crashes."""
        self._shm.unlink()

    def close(self) -> None:
        self._written = self._read = None  # type: ignore[assignment]
        self._slots = None  # type: ignore[assignment]
        # BufferError: a caller still holds a view; the mapping goes with the process.
        with contextlib.suppress(BufferError):
            self._shm.close()

    # ---- the collective -------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (in rank order) of `tensor`, written into `tensor` when it is
        contiguous (else into a new tensor); the result is returned."""
        out = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = out.view(-1)
        per_chunk = self.slot_bytes // out.element_size()
        for start in range(0, flat.numel(), per_chunk):
            self._reduce_chunk(flat[start : start + per_chunk])
        return out

    def _reduce_chunk(self, chunk: torch.Tensor) -> None:
        self.seq += 1
        seq, rank = self.seq, self.rank
        bank = self._slots[seq % 2]
        num_bytes = chunk.numel() * chunk.element_size()
        slots = [bank[r, :num_bytes].view(chunk.dtype) for r in range(self.world_size)]
        # Every rank must have finished reading this bank's previous use (operation seq - 2).
        self._wait(self._read, seq - 2)
        slots[rank].copy_(chunk)
        self._written[rank] = seq
        self._wait(self._written, seq)
        if self.world_size == 1:
            chunk.copy_(slots[0])
        else:
            torch.add(slots[0], slots[1], out=chunk)
            for slot in slots[2:]:
                chunk.add_(slot)
        self._read[rank] = seq

    def _wait(self, counters: np.ndarray, target: int) -> None:
        if counters.min() >= target:
            return
        spins = 0
        deadline = time.monotonic() + self.timeout_s
        while counters.min() < target:
            spins += 1
            if spins > _SPIN:
                os.sched_yield()
            if spins % _CHECK_EVERY == 0 and time.monotonic() > deadline:
                late = [r for r in range(self.world_size) if counters[r] < target]
                raise TimeoutError(
                    f"shared-memory all-reduce: rank(s) {late} of the group did not arrive "
                    f"within {self.timeout_s:.0f} s (a rank died or hangs)"
                )


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Attach without registering with a resource tracker: rank 0 created (and tracks) the
    segment and drops its name once all have attached. Python < 3.13 registers attached
    segments too, and a tracker shared with rank 0 (spawned siblings) or one of its own
    would then unregister or unlink the name a second time, with a traceback at exit."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    except TypeError:  # Python < 3.13: no `track`
        pass
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register
