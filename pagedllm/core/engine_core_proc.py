"""The engine-core process: a busy loop around `EngineCore`, fed and drained over ZMQ.

Two IO threads keep sockets off the loop: one decodes incoming messages into a queue, one
encodes outputs and sends them. The loop drains the input queue, steps while any request
is unfinished, and blocks on the queue only when idle. It exits on a `Shutdown` message,
when the API process that started it is gone, or (non-zero) when a step raises.

Signals: the API process owns shutdown and key reloads, so SIGINT, SIGTERM and SIGHUP are
ignored here. Ctrl-C, a terminal hang-up and systemd's `KillMode=control-group` signal the
whole process group at once; a core that died on its SIGTERM would fail the requests the
API process is still draining.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
from typing import Any

import torch
import zmq

from pagedllm.config import EngineArgs
from pagedllm.core.engine_config import load_engine_config
from pagedllm.core.engine_core import EngineCore
from pagedllm.core.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    Shutdown,
    event_encoder,
    input_decoder,
)
from pagedllm.errors import describe_error
from pagedllm.logger import init_logger
from pagedllm.metrics.core.logger import StatLogger
from pagedllm.process_exit import exit_now

logger = logging.getLogger("pagedllm")

# How often an idle loop checks that the API process is still alive.
IDLE_POLL_S = 1.0


def run_engine_core(
    args: EngineArgs,
    input_address: str,
    output_address: str,
    engine_index: int = 0,
    parent_pid: int | None = None,
) -> None:
    """Entry point of the child process (started with the `spawn` method); `engine_index`:
    which of the `data_parallel_size` cores this is; `parent_pid`: the API process's pid, as
    it knew it (read here instead, a parent that died while this process started would be
    mistaken for the process that adopted it, and the core would outlive it)."""
    if parent_pid is None:
        parent_pid = os.getppid()
    elif os.getppid() != parent_pid:
        return  # the API process is already gone
    # Ctrl-C and a SIGTERM or SIGHUP (key reload) sent to the whole process group reach this
    # process too; the API process decides what they mean (it sends Shutdown, or kills this).
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    init_logger()
    if args.data_parallel_size > 1:
        share_cpu_threads(args.data_parallel_size)
    try:
        _, tokenizer, config = load_engine_config(args, log=engine_index == 0)
        core = EngineCore(config, tokenizer)
        stat_logger = None
        if not args.disable_log_stats:
            stat_logger = StatLogger(engine_index if args.data_parallel_size > 1 else None)
        EngineCoreProc(core, input_address, output_address, stat_logger, parent_pid).run()
    except Exception:
        logger.exception("Engine core failed")
        sys.exit(1)
    # Shut down: the API process waits for this exit, and the teardown of a process holding
    # a model would add about a second to every stop.
    exit_now(0)


def share_cpu_threads(num_engines: int) -> None:
    """Data-parallel cores share this host's CPUs: each runs its share of the threads, so
    N cores do not oversubscribe the cores with N times the host's thread count."""
    if hasattr(os, "sched_getaffinity"):
        num_cpus = len(os.sched_getaffinity(0))
    else:
        num_cpus = os.cpu_count() or 1
    torch.set_num_threads(max(1, num_cpus // num_engines))


class EngineCoreProc:
    def __init__(
        self,
        core: EngineCore,
        input_address: str,
        output_address: str,
        stat_logger: StatLogger | None,
        parent_pid: int,
    ) -> None:
        self.core = core
        self.parent_pid = parent_pid
        self.stat_logger = stat_logger
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.context = zmq.Context()
        self._start_io_thread(self._read_inputs, input_address, zmq.PULL)
        self._start_io_thread(self._write_outputs, output_address, zmq.PUSH)

    def _start_io_thread(self, target, address: str, socket_type: int) -> None:
        socket = self.context.socket(socket_type)
        socket.connect(address)
        threading.Thread(target=target, args=(socket,), daemon=True).start()

    def _read_inputs(self, socket: zmq.Socket) -> None:
        while True:
            self.input_queue.put(input_decoder.decode(socket.recv()))

    def _write_outputs(self, socket: zmq.Socket) -> None:
        while True:
            socket.send(event_encoder.encode(self.output_queue.get()))

    def run(self) -> None:
        self.output_queue.put(EngineReady(os.getpid()))
        while True:
            busy = self.core.has_unfinished_requests()
            if not self._drain_inputs(block=not busy):
                return
            if self.core.has_unfinished_requests():
                self._step()
                # A busy core checks too: it ignores SIGTERM, so an API process killed
                # outright must not leave it running out its queue.
                if self._parent_gone():
                    return

    def _step(self) -> None:
        outputs = self.core.step()
        if self.stat_logger is not None:
            self.stat_logger.record(outputs)
        self.output_queue.put(outputs)

    def _drain_inputs(self, block: bool) -> bool:
        """Apply every waiting message (waiting for one when idle); False on shutdown."""
        num_aborts = 0
        while True:
            try:
                message = self.input_queue.get(block=block, timeout=IDLE_POLL_S)
            except queue.Empty:
                if not block:
                    break
                if self._parent_gone():
                    return False
                continue
            block = False
            if isinstance(message, Shutdown):
                return False
            num_aborts += self._apply(message)
        if num_aborts and not self.core.has_unfinished_requests():
            # No step follows to report the freed blocks, so report them now.
            self.output_queue.put(EngineCoreOutputs([], self.core.get_stats()))
        return True

    def _parent_gone(self) -> bool:
        if os.getppid() == self.parent_pid:
            return False
        logger.warning("API process is gone; engine core exits")
        return True

    def _add_request(self, request: EngineCoreRequest) -> None:
        """A request the core refuses (the edge should have) fails alone, not the core."""
        try:
            self.core.add_request(request)
        except Exception as error:
            logger.exception("Engine core refused request %s", request.request_id)
            failed = EngineCoreOutput(
                request.request_id, [], True, finish_reason="error", error=describe_error(error)
            )
            self.output_queue.put(EngineCoreOutputs([failed], self.core.get_stats()))

    def _apply(self, message: Any) -> int:
        """Apply one input; returns how many requests it aborted."""
        if isinstance(message, EngineCoreRequest):
            self._add_request(message)
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
            return len(message.request_ids)
        return 0
