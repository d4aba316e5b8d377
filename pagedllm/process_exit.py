"""Ending a process that is done without Python's interpreter teardown.

A server process (the API process, an engine core) holds torch, transformers and a model:
once its work is done, the interpreter's teardown (every module cleared, a final garbage
collection over millions of objects) takes about a second of CPU in each, and a stop waits
for both, one after the other. `exit_now` does what an exit must do, in the interpreter's
order (the threads that are not daemons joined, with the work queued to thread-pool
executors, which register there; then the `atexit` handlers: logging's flush,
multiprocessing's reaping of child processes, weak-reference finalizers such as a temporary
folder's removal; the standard streams flushed) and then ends the process at once, leaving
the memory to the operating system.

Only for a process's last step, where its own code has closed what it opened: objects still
alive are not finalized (an unflushed file object that was never closed loses its buffer).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_now(status: int) -> NoReturn:
    """End the process with `status` after the `atexit` handlers, without the teardown."""
    # What the interpreter runs first at exit: joins the non-daemon threads and runs the
    # callbacks of `threading._register_atexit` (an executor finishing its queued work).
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()  # what the interpreter would run at exit, in the same order
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream has nothing to give
            stream.flush()
    os._exit(status)
