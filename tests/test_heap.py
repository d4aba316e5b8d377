"""`pagedllm.heap.trim_heap`: memory a worker thread freed, held resident in its malloc arena
(the LoRA adapter check's case), goes back to the system."""

from __future__ import annotations

import ctypes
import threading

import psutil

from pagedllm import heap
from pagedllm.heap import trim_heap

CHUNK_BYTES = 64 * 1024  # below glibc's mmap threshold: served from the thread's arena
NUM_CHUNKS = 1024  # 64 MiB in all


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _free_all_but_the_last(libc: ctypes.CDLL, kept: list[int]) -> None:
    """In its own thread (its own arena): touch 64 MiB of chunks, free all but the last, which
    pins the arena's top, so the freed ones stay resident in it."""
    chunks = []
    for _ in range(NUM_CHUNKS):
        address = libc.malloc(CHUNK_BYTES)
        ctypes.memset(address, 1, CHUNK_BYTES)
        chunks.append(address)
    for address in chunks[:-1]:
        libc.free(address)
    kept.append(chunks[-1])


def test_trim_heap_returns_a_threads_freed_memory():
    # The project's machines (Debian, the CI image) run glibc, which has malloc_trim.
    assert trim_heap(), "this C library has no malloc_trim"
    libc = _libc()
    process = psutil.Process()
    kept: list[int] = []
    thread = threading.Thread(target=_free_all_but_the_last, args=(libc, kept))
    thread.start()
    thread.join()
    try:
        held = process.memory_info().rss
        assert trim_heap()
        released = held - process.memory_info().rss
    finally:
        libc.free(kept[0])
    # Nearly all of the 64 MiB freed comes back (what glibc keeps is a few pages an arena).
    assert released > NUM_CHUNKS * CHUNK_BYTES // 2, f"{released} bytes released"


def test_trim_heap_is_a_no_op_where_the_c_library_has_no_malloc_trim(monkeypatch):
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    assert trim_heap() is False
