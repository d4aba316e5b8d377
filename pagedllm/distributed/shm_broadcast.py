"""One writer, several readers on one host: each message sent once reaches every reader.

The multiprocess executor broadcasts every RPC (a `SchedulerOutput` each step) to all its
workers through one of two channels with the same interface:

- `PipeBroadcast`: one pipe per reader; the writer writes the bytes to each pipe in turn.
- `ShmBroadcast`: a ring of `num_chunks` fixed-size chunks in one shared-memory segment.
  The writer copies a message once into the next chunk and posts each reader's semaphore
  (a blocking wait in the kernel, no spinning: on a small host the readers share cores
  with the writer). A reader copies its message out and counts it read in the segment; the
  writer reuses a chunk once every reader has read it. A message larger than a chunk goes
  through each reader's overflow pipe instead, with a marker in the ring (so order holds).

Both are built by the writer before the readers start; `reader(i)` is the picklable end
handed to reader `i` as a process argument (semaphores and pipes pass only that way).
`benchmarks/broadcast_cost.py` measures both; `DEFAULT_CHANNEL` is the faster there.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np

# Measured by benchmarks/broadcast_cost.py (a 64-request decode step's SchedulerOutput).
DEFAULT_CHANNEL = "shm"
CHANNELS = ("shm", "pipe")

_OVERFLOW = -1  # a chunk's length field: the message is in the reader's overflow pipe
_HEADER_WORDS = 2  # per chunk: the message's sequence number, its length


class BroadcastReader(Protocol):
    def recv(self, timeout: float | None = None) -> bytes:
        """The next message; TimeoutError when none came within `timeout` seconds."""
        ...

    def close(self) -> None: ...


class Broadcast(Protocol):
    num_readers: int

    def send(self, payload: bytes, timeout: float | None = None) -> None: ...

    def reader(self, index: int) -> BroadcastReader: ...

    def close_reader_ends(self) -> None:
        """Drop the writer's copies of the readers' ends, once the readers hold them."""
        ...

    def close(self) -> None: ...


def create_broadcast(channel: str, num_readers: int, context: Any = None) -> Broadcast:
    context = context or multiprocessing.get_context("spawn")
    if channel == "shm":
        return ShmBroadcast(num_readers, context=context)
    if channel == "pipe":
        return PipeBroadcast(num_readers, context=context)
    raise ValueError(f"broadcast channel must be one of {list(CHANNELS)}, got {channel!r}")


# ---- pipes ------------------------------------------------------------------------------
class PipeReader:
    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def recv(self, timeout: float | None = None) -> bytes:
        if timeout is not None and not self.connection.poll(timeout):
            raise TimeoutError(f"no message within {timeout} s")
        return self.connection.recv_bytes()

    def close(self) -> None:
        self.connection.close()


class PipeBroadcast:
    def __init__(self, num_readers: int, context: Any = None) -> None:
        context = context or multiprocessing.get_context("spawn")
        self.num_readers = num_readers
        pairs = [context.Pipe(duplex=False) for _ in range(num_readers)]
        self._readers = [PipeReader(receive) for receive, _ in pairs]
        self._writers = [send for _, send in pairs]

    def send(self, payload: bytes, timeout: float | None = None) -> None:
        for connection in self._writers:
            connection.send_bytes(payload)

    def reader(self, index: int) -> PipeReader:
        return self._readers[index]

    def close_reader_ends(self) -> None:
        for reader in self._readers:
            reader.close()

    def close(self) -> None:
        for connection in self._writers:
            connection.close()


# ---- shared-memory ring -----------------------------------------------------------------
class _Ring:
    """The segment's layout: per chunk a header (sequence, length) and its bytes, then one
    read counter per reader. Aligned int64 stores are atomic on the hosts we run on, and the
    semaphore post/wait orders the chunk's bytes before the reader looks at them."""

    def __init__(self, buffer: memoryview, num_readers: int, num_chunks: int, chunk_bytes: int):
        self.num_chunks, self.chunk_bytes = num_chunks, chunk_bytes
        header_bytes = num_chunks * _HEADER_WORDS * 8
        self.headers = np.ndarray(
            (num_chunks, _HEADER_WORDS), dtype=np.int64, buffer=buffer, offset=0
        )
        self.read_counts = np.ndarray(
            (num_readers,), dtype=np.int64, buffer=buffer, offset=header_bytes
        )
        self.data_offset = header_bytes + num_readers * 8
        self.buffer = buffer

    @staticmethod
    def size(num_readers: int, num_chunks: int, chunk_bytes: int) -> int:
        return num_chunks * (_HEADER_WORDS * 8 + chunk_bytes) + num_readers * 8

    def chunk(self, index: int) -> memoryview:
        start = self.data_offset + index * self.chunk_bytes
        return self.buffer[start : start + self.chunk_bytes]


class ShmReader:
    """Reader `index`'s end: the segment's name, its semaphore and its overflow pipe."""

    def __init__(self, name, index, num_readers, num_chunks, chunk_bytes, semaphore, overflow):
        self.name, self.index = name, index
        self.layout = (num_readers, num_chunks, chunk_bytes)
        self.semaphore, self.overflow = semaphore, overflow
        self._shm: shared_memory.SharedMemory | None = None
        self._ring: _Ring | None = None
        self._next = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_shm": None, "_ring": None}

    def _attach(self) -> _Ring:
        # The writer owns the segment. Python >= 3.13 can say so (track=False); before, the
        # reader registers it with the resource tracker it shares with the writer (spawned
        # children inherit it), where registering twice is once.
        try:
            self._shm = shared_memory.SharedMemory(name=self.name, track=False)
        except TypeError:
            self._shm = shared_memory.SharedMemory(name=self.name)
        self._ring = _Ring(self._shm.buf, *self.layout)
        return self._ring

    def recv(self, timeout: float | None = None) -> bytes:
        ring = self._ring or self._attach()
        if not self.semaphore.acquire(timeout=timeout):
            raise TimeoutError(f"no message within {timeout} s")
        slot = self._next % ring.num_chunks
        sequence, length = ring.headers[slot]
        if sequence != self._next:
            raise RuntimeError(
                f"broadcast ring out of step: chunk holds {sequence}, "
                f"reader {self.index} expected {self._next}"
            )
        if length == _OVERFLOW:
            payload = self.overflow.recv_bytes()
        else:
            payload = bytes(ring.chunk(slot)[:length])
        self._next += 1
        ring.read_counts[self.index] = self._next
        return payload

    def close(self) -> None:
        if self._shm is not None:
            self._ring = None
            self._shm.close()
            self._shm = None
        self.overflow.close()


class ShmBroadcast:
    def __init__(
        self,
        num_readers: int,
        num_chunks: int = 8,
        chunk_bytes: int = 1 << 20,
        context: Any = None,
    ) -> None:
        context = context or multiprocessing.get_context("spawn")
        self.num_readers = num_readers
        self._shm = shared_memory.SharedMemory(
            create=True, size=_Ring.size(num_readers, num_chunks, chunk_bytes)
        )
        self._ring = _Ring(self._shm.buf, num_readers, num_chunks, chunk_bytes)
        self._ring.headers[:] = -1
        self._ring.read_counts[:] = 0
        self._semaphores = [context.Semaphore(0) for _ in range(num_readers)]
        pipes = [context.Pipe(duplex=False) for _ in range(num_readers)]
        self._overflow = [send for _, send in pipes]
        self._readers = [
            ShmReader(
                self._shm.name, i, num_readers, num_chunks, chunk_bytes, self._semaphores[i], r
            )
            for i, (r, _) in enumerate(pipes)
        ]
        self._sent = 0

    def send(self, payload: bytes, timeout: float | None = None) -> None:
        ring = self._ring
        if ring is None:
            raise RuntimeError("broadcast is closed")
        # The chunk last held message `sent - num_chunks`: wait until every reader read it.
        oldest = self._sent - ring.num_chunks + 1
        deadline = None if timeout is None else time.monotonic() + timeout
        while int(ring.read_counts.min()) < oldest:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"a reader is {ring.num_chunks} messages behind")
            time.sleep(0.0001)
        slot = self._sent % ring.num_chunks
        overflow = len(payload) > ring.chunk_bytes
        if not overflow:
            ring.chunk(slot)[: len(payload)] = payload
        ring.headers[slot] = (self._sent, _OVERFLOW if overflow else len(payload))
        self._sent += 1
        for semaphore in self._semaphores:
            semaphore.release()
        if overflow:  # after the posts: each reader drains its pipe as it is written
            for connection in self._overflow:
                connection.send_bytes(payload)

    def reader(self, index: int) -> ShmReader:
        return self._readers[index]

    def close_reader_ends(self) -> None:
        for reader in self._readers:
            reader.overflow.close()

    def close(self) -> None:
        if self._ring is None:
            return
        self._ring = None
        for connection in self._overflow:
            connection.close()
        self._shm.close()
        self._shm.unlink()
