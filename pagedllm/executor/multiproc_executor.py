"""`MultiprocExecutor`: one worker process per rank on this host (backend "mp").

The engine core's process holds no model: it spawns `world_size` processes
(`worker/worker_proc.py`), each building `Worker(config, rank, distributed_init_method)`.
Every `collective_rpc` is pickled once and broadcast to all workers
(`distributed/shm_broadcast.py`); each worker answers on its own reply pipe, and the replies
come back in rank order. `execute_model` returns the output rank's reply (the first
tensor-parallel rank of the last pipeline stage, the one that samples).

Failures end the engine loudly and leave nothing behind:
- the executor waits on the reply pipes *and* the processes' sentinels, so a worker that
  dies raises at once (its rank and exit code), and one that does not answer within
  `PAGEDLLM_RPC_TIMEOUT_S` (default 600 s) raises too;
- a worker's exception is re-raised here with its rank and the worker's traceback text;
- after any of these the executor stops every worker (the ranks of a broken world cannot
  go on) and refuses further calls;
- workers die with this process (see worker_proc.py), and `shutdown` (also run when the
  executor is collected or the interpreter exits) asks them to stop, then terminates and
  kills what is left.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.shm_broadcast import DEFAULT_CHANNEL, Broadcast, create_broadcast
from pagedllm.executor.abstract import Executor
from pagedllm.utils import free_port
from pagedllm.worker.worker_proc import READY, WorkerFailure, WorkerSpec, worker_main

logger = logging.getLogger("pagedllm")

RPC_TIMEOUT_ENV = "PAGEDLLM_RPC_TIMEOUT_S"
BROADCAST_ENV = "PAGEDLLM_BROADCAST"  # "shm" or "pipe" (benchmarks/broadcast_cost.py)
DEFAULT_RPC_TIMEOUT_S = 600.0
# Starting a worker imports torch and may load nothing yet; init_device joins the world.
STARTUP_TIMEOUT_S = 300.0
SHUTDOWN_GRACE_S = 5.0


class WorkerError(RuntimeError):
    """A worker raised, died or did not answer; the executor is unusable afterwards."""


def rpc_timeout_s() -> float:
    value = float(os.environ.get(RPC_TIMEOUT_ENV, DEFAULT_RPC_TIMEOUT_S))
    if not value > 0:
        raise ValueError(f"{RPC_TIMEOUT_ENV} must be a positive number of seconds")
    return value


class FutureReply:
    """An `execute_model` answered later (pipeline parallelism keeps several in flight).

    Replies arrive in the order calls were sent, so `result()` first collects those of the
    calls sent before this one."""

    def __init__(self, executor: MultiprocExecutor, method: str) -> None:
        self._executor, self._method = executor, method
        self._done = False
        self._result: Any = None

    def done(self) -> bool:
        return self._done

    def result(self) -> Any:
        while not self._done:
            self._executor._collect_oldest()
        return self._result

    def _set(self, result: Any) -> None:
        self._result, self._done = result, True


class MultiprocExecutor(Executor):
    # "module:Class" of what each process builds (tests swap in a worker with no model).
    worker_class = "pagedllm.worker.worker:Worker"

    def _init_executor(self) -> None:
        parallel = self.config.parallel_config
        self.world_size = parallel.world_size
        self.output_rank = (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size
        self.rpc_timeout_s = rpc_timeout_s()
        self._failed: str | None = None
        self._pending: deque[tuple[FutureReply, str, int]] = deque()
        self._processes: list[Any] = []
        context = multiprocessing.get_context("spawn")
        self._broadcast: Broadcast = create_broadcast(
            os.environ.get(BROADCAST_ENV, DEFAULT_CHANNEL), self.world_size, context
        )
        self._replies: list[Connection] = []
        # Only this process writes to these; a worker's read end reports EOF when we go.
        self._alive_writers: list[Connection] = []
        # Stop the workers however this executor ends (collected, interpreter exit).
        self._finalizer = weakref.finalize(
            self, _stop_workers, self._processes, self._broadcast, self._alive_writers
        )
        init_method = f"tcp://127.0.0.1:{free_port()}"
        in_main_thread = threading.current_thread() is threading.main_thread()
        for rank in range(self.world_size):
            spec = WorkerSpec(
                worker_class=self.worker_class,
                config=self.config,
                rank=rank,
                distributed_init_method=init_method,
                parent_pid=os.getpid(),
                die_with_parent_thread=in_main_thread,
            )
            reply_read, reply_write = context.Pipe(duplex=False)
            alive_read, alive_write = context.Pipe(duplex=False)
            process = context.Process(
                target=worker_main,
                args=(spec, self._broadcast.reader(rank), reply_write, alive_read),
                name=f"pagedllm-worker-{rank}",
                daemon=True,
            )
            process.start()
            reply_write.close()  # the worker holds it now: EOF here when it exits
            alive_read.close()
            self._processes.append(process)
            self._replies.append(reply_read)
            self._alive_writers.append(alive_write)
        self._broadcast.close_reader_ends()
        ready = self._gather("init_device", STARTUP_TIMEOUT_S)
        assert ready == [READY] * self.world_size, ready
        logger.info("mp executor: %d worker processes ready", self.world_size)

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.parallel_config.pipeline_parallel_size

    # ---- RPCs ---------------------------------------------------------------------------
    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        self._send(method, args, kwargs)
        while self._pending:  # replies to earlier non-blocking calls come first
            self._collect_oldest()
        return self._gather(method, self.rpc_timeout_s)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | FutureReply:
        if not non_block:
            return self.collective_rpc("execute_model", (scheduler_output,))[self.output_rank]
        self._send("execute_model", (scheduler_output,), None)
        future = FutureReply(self, "execute_model")
        self._pending.append((future, "execute_model", self.output_rank))
        return future

    def _send(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
        if self._failed is not None:
            raise WorkerError(f"the executor's workers are gone: {self._failed}")
        payload = pickle.dumps((method, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._broadcast.send(payload, timeout=self.rpc_timeout_s)
        except (OSError, TimeoutError) as error:  # a reader went away, or stopped reading
            self._fail(f"broadcasting {method} failed: {error!r}; {self._dead_ranks() or ''}")

    def _collect_oldest(self) -> None:
        future, method, rank = self._pending.popleft()
        future._set(self._gather(method, self.rpc_timeout_s)[rank])

    def _gather(self, method: str, timeout_s: float) -> list[Any]:
        """One reply per worker, in rank order; raises on a failure, death or timeout."""
        replies: dict[int, Any] = {}
        closed: set[int] = set()  # reply pipes at EOF: their worker exited
        by_connection = {connection: rank for rank, connection in enumerate(self._replies)}
        by_sentinel = {process.sentinel: rank for rank, process in enumerate(self._processes)}
        deadline = time.monotonic() + timeout_s
        while len(replies) < self.world_size:
            waiting = [
                c for c, rank in by_connection.items() if rank not in replies and rank not in closed
            ]
            remaining = deadline - time.monotonic()
            ready = wait(waiting + list(by_sentinel), timeout=max(remaining, 0))
            if not ready:
                missing = sorted(set(range(self.world_size)) - set(replies))
                self._fail(
                    f"worker rank(s) {missing} did not answer {method} within {timeout_s:g} s "
                    f"({RPC_TIMEOUT_ENV})"
                )
            for handle in ready:
                if handle in by_connection:
                    rank = by_connection[handle]
                    try:
                        ok, value = handle.recv()
                    except (EOFError, OSError):
                        closed.add(rank)  # it exited: its sentinel says how
                        continue
                    if not ok:
                        self._raise_failure(value)
                    replies[rank] = value
            # A worker exited. What any worker sent before that is read first (next round).
            if any(s in by_sentinel for s in ready) and not any(
                c.poll() for c in waiting if by_connection[c] not in closed
            ):
                self._fail(f"during {method}: {self._dead_ranks()}")
        return [replies[rank] for rank in range(self.world_size)]

    def _raise_failure(self, failure: WorkerFailure) -> None:
        # A peer's death often surfaces first as a failed collective elsewhere: name it.
        time.sleep(0.05)
        dead = self._dead_ranks()
        self._fail(
            f"worker rank {failure.rank} raised in {failure.method}: {failure.error}"
            + (f" ({dead})" if dead else "")
            + f"\n--- worker rank {failure.rank} traceback ---\n{failure.traceback}"
        )

    def _dead_ranks(self) -> str:
        for process in self._processes:  # an exiting process is reaped within moments
            if wait([process.sentinel], timeout=0):
                process.join(1.0)
        dead = [
            f"worker rank {rank} (pid {process.pid}) died with exit code {process.exitcode}"
            for rank, process in enumerate(self._processes)
            if process.exitcode is not None
        ]
        return "; ".join(dead)

    def _fail(self, message: str) -> None:
        """The world is broken: stop every worker, refuse further calls, raise."""
        self._failed = message.splitlines()[0]
        self._pending.clear()
        _stop_workers(self._processes, self._broadcast, self._alive_writers, graceful=False)
        raise WorkerError(message)

    # ---- end ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        return [process.pid for process in self._processes]


def _stop_workers(
    processes: list[Any],
    broadcast: Broadcast,
    alive_writers: list[Connection],
    graceful: bool = True,
) -> None:
    """Ask the workers to stop (graceful), then terminate and kill what is left; release
    the broadcast. Safe to call more than once."""
    if graceful and any(p.is_alive() for p in processes):
        # A worker gone or stuck makes this raise: the signals below end it.
        with contextlib.suppress(Exception):
            broadcast.send(pickle.dumps(None), timeout=1.0)
        _join_all(processes, SHUTDOWN_GRACE_S)
    for process in processes:
        if process.is_alive():
            process.terminate()
    _join_all(processes, 2.0)
    for process in processes:
        if process.is_alive():
            process.kill()
    _join_all(processes, 2.0)
    for connection in alive_writers:
        connection.close()
    broadcast.close()


def _join_all(processes: list[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
