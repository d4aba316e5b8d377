"""A worker process's main (the `mp` executor): build one rank's `Worker`, serve its RPCs.

The process lives exactly as long as its parent wants it to:
- it dies with its parent: `PR_SET_PDEATHSIG` (Linux; SIGKILL when the spawning thread's
  process goes), and a thread that waits on a pipe only the parent writes to and exits on
  its EOF (any OS, and any way the parent ends);
- SIGINT is ignored (Ctrl-C reaches the whole process group; the parent owns shutdown),
  SIGTERM has its default action (the executor's `terminate`), whatever was inherited;
- a `None` message, or the broadcast or reply pipe closing, ends the serve loop.

Protocol: every message is a pickled `(method, args, kwargs)`; each is answered on the
reply pipe, in order, with `(True, result)` or `(False, WorkerFailure)`. The first reply,
sent after `init_device`, says whether the worker started.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.distributed.shm_broadcast import BroadcastReader
from pagedllm.process_exit import exit_now

_PR_SET_PDEATHSIG = 1
READY = "ready"


@dataclass(frozen=True)
class WorkerFailure:
    """What raised in a worker, as text (the exception itself may not pickle)."""

    rank: int
    method: str
    error: str  # "Type: message"
    traceback: str


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to build its `Worker` (picklable, passed at spawn)."""

    worker_class: str  # "module:Class"
    config: Any
    rank: int
    distributed_init_method: str
    parent_pid: int
    # PR_SET_PDEATHSIG fires when the *thread* that spawned the process ends; the executor
    # asks for it only when that thread is the main one (else the death pipe alone).
    die_with_parent_thread: bool


def worker_main(
    spec: WorkerSpec,
    messages: BroadcastReader,
    replies: Connection,
    parent_alive: Connection,
) -> None:
    _die_with_parent(spec, parent_alive)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    worker = None
    try:
        worker = _build_worker(spec)
        worker.init_device()
        replies.send((True, READY))
    except BaseException as error:
        _send_failure(replies, spec.rank, "init_device", error)
        return
    try:
        _serve(worker, spec.rank, messages, replies)
    finally:
        shutdown = getattr(worker, "shutdown", None)
        if shutdown is not None:
            shutdown()
    # The executor waits for this exit at every shutdown: a process holding its part of the
    # model would spend about a second more in the interpreter's teardown.
    exit_now(0)


def _serve(worker: Any, rank: int, messages: BroadcastReader, replies: Connection) -> None:
    while True:
        try:
            payload = messages.recv()
        except (EOFError, OSError):  # the executor is gone
            return
        message = pickle.loads(payload)
        if message is None:  # shutdown
            return
        method, args, kwargs = message
        try:
            reply = (True, getattr(worker, method)(*args, **kwargs))
        except BaseException as error:
            _send_failure(replies, rank, method, error)
            continue
        try:
            replies.send(reply)
        except (BrokenPipeError, EOFError, OSError):
            return
        except Exception as error:  # the result did not pickle: say so, keep serving
            _send_failure(replies, rank, method, error)


def _send_failure(replies: Connection, rank: int, method: str, error: BaseException) -> None:
    failure = WorkerFailure(
        rank=rank,
        method=method,
        error=f"{type(error).__name__}: {error}",
        traceback="".join(traceback.format_exception(error)),
    )
    with contextlib.suppress(BrokenPipeError, EOFError, OSError):
        replies.send((False, failure))


def _build_worker(spec: WorkerSpec) -> Any:
    module_name, _, class_name = spec.worker_class.partition(":")
    worker_class = getattr(importlib.import_module(module_name), class_name)
    return worker_class(
        spec.config, rank=spec.rank, distributed_init_method=spec.distributed_init_method
    )


def _die_with_parent(spec: WorkerSpec, parent_alive: Connection) -> None:
    if spec.die_with_parent_thread and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    # The parent may have died before prctl ran: then we were reparented already.
    if os.getppid() != spec.parent_pid:
        os._exit(1)

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            parent_alive.recv_bytes()  # nothing is ever sent: returns only at EOF
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
