"""Stop a thread's Python code at a deadline: a watchdog thread raises in it.

A thread cannot be killed, but `PyThreadState_SetAsyncExc` has an exception raised in it at
its next function call or backward jump (the check CPython makes for KeyboardInterrupt),
which stops loops that emit nothing as surely as loops that emit text. One daemon watchdog
thread serves the process; a thread that finishes in time pays nothing (no tracing).
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import threading
import time


class DeadlineExceeded(BaseException):
    """Raised in the watched thread at its deadline. A BaseException, so no
    `except Exception` between the watched code and its caller swallows it."""


def _raise_in_thread(thread_id: int, exception: type[BaseException] | None) -> None:
    """Have `exception` raised in the thread at its next function call or backward jump
    (the check CPython makes for KeyboardInterrupt); None withdraws one not raised yet."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), None if exception is None else ctypes.py_object(exception)
    )


class ThreadDeadline:
    """One rendering's deadline. `interrupt` (the watchdog's) and `finish` (the renderer's)
    take the same lock, so `DeadlineExceeded` is raised only while the rendering is running and a
    raise still pending when it finishes is withdrawn: it can never land after it."""

    __slots__ = ("deadline", "done", "fired", "lock", "thread_id")

    def __init__(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.thread_id = threading.get_ident()
        self.lock = threading.Lock()
        self.done = False
        self.fired = False

    def interrupt(self) -> None:
        with self.lock:
            if not self.done:
                self.fired = True
                _raise_in_thread(self.thread_id, DeadlineExceeded)

    def finish(self) -> None:
        with self.lock:
            self.done = True
            if self.fired:
                _raise_in_thread(self.thread_id, None)


class _Watchdog:
    """One daemon thread for the process, interrupting each rendering at its deadline. It
    costs a rendering nothing while it runs (no tracing), and needs the GIL only at a
    deadline, which CPython hands over within its switch interval (5 ms)."""

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._heap: list[tuple[float, int, ThreadDeadline]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, render: ThreadDeadline) -> None:
        with self._wake:
            heapq.heappush(self._heap, (render.deadline, next(self._order), render))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="chat-template-watchdog", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        with self._wake:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._wake.wait()
                    continue
                wait_s = self._heap[0][0] - time.monotonic()
                if wait_s > 0:
                    self._wake.wait(wait_s)
                    continue
                heapq.heappop(self._heap)[2].interrupt()


_WATCHDOG = _Watchdog()


def start_deadline(timeout_s: float) -> ThreadDeadline:
    """Watch the calling thread: `DeadlineExceeded` is raised in it after `timeout_s` unless
    it calls `finish()` on the returned deadline first."""
    deadline = ThreadDeadline(timeout_s)
    _WATCHDOG.watch(deadline)
    return deadline
