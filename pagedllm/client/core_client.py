"""Clients of the engine core: `InprocClient` (the core in this process, for `LLMEngine`),
`DPInprocClient` (N data-parallel cores in this process, for `LLMEngine` with
`data_parallel_size` N > 1) and `MPClient` (the core in a process of its own, for the server's
`AsyncLLM`, which runs one per data-parallel core).

Both send `EngineCoreRequest`s and aborts in and get `EngineCoreOutputs` back. `MPClient`
binds two IPC sockets (requests out, events in) and spawns the core, which connects to them.
Sends go through an asyncio ZMQ socket, so the event loop never blocks on the engine;
`events()` yields what the core reports and raises `EngineDeadError` when the process is gone.
An `MPClient` serves one core process: to restart the core, `AsyncLLM` kills it
(`kill_now`) and builds a new client.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import os
import tempfile
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from pagedllm.client.dp_router import DPRouter, routing_policy_from_env
from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.core.engine_core import EngineCore
from pagedllm.core.engine_core_proc import run_engine_core
from pagedllm.core.messages import (
    EngineCoreEvent,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    Shutdown,
    event_decoder,
    input_encoder,
)
from pagedllm.core.request import child_request_id
from pagedllm.errors import EngineDeadError
from pagedllm.metrics.stats import EngineStats, sum_engine_stats

logger = logging.getLogger("pagedllm")

# How often a waiting receiver checks that the engine process is alive.
LIVENESS_POLL_MS = 200


class InprocClient:
    """The engine core in this process: each `get_output` runs one step."""

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.engine_core = EngineCore(config, tokenizer)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class DPInprocClient:
    """`data_parallel_size` N > 1 in one process: N engine cores, each with its own scheduler,
    KV cache and model copy. `DPRouter` picks each request's core (prefix held, then load);
    a step steps every core that has unfinished requests, one after the other, and reports
    their outputs together with the sum of their stats."""

    def __init__(self, config: EngineConfig, tokenizer: Any, num_engines: int) -> None:
        self.clients: list[InprocClient] = []
        try:
            for _ in range(num_engines):
                self.clients.append(InprocClient(config, tokenizer))
        except BaseException:  # the cores built so far must not leave worker processes
            self.shutdown()
            raise
        self.block_size = config.cache_config.block_size
        self.router = DPRouter(
            num_engines, config.cache_config.num_blocks, routing_policy_from_env()
        )

    @property
    def engine_core(self) -> EngineCore:
        return self.clients[0].engine_core

    @property
    def engine_cores(self) -> list[EngineCore]:
        return [client.engine_core for client in self.clients]

    def add_request(self, request: EngineCoreRequest) -> None:
        engine = self.router.route_request(request, self.block_size)
        try:
            self.clients[engine].add_request(request)
        except BaseException:  # nothing of it runs there: release its load
            samples = range(request.sampling_params.n)
            self.router.finish_all(child_request_id(request.request_id, i) for i in samples)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        for engine, ids in self.router.finish_all(request_ids).items():
            self.clients[engine].abort_requests(ids)

    def get_output(self) -> EngineCoreOutputs:
        busy = [client for client in self.clients if client.has_unfinished_requests()]
        stepped = [client.get_output() for client in busy or self.clients[:1]]
        outputs = [output for step in stepped for output in step.outputs]
        self.router.finish_outputs(outputs)
        return EngineCoreOutputs(outputs, self.get_stats())

    def has_unfinished_requests(self) -> bool:
        return any(client.has_unfinished_requests() for client in self.clients)

    def get_stats(self) -> EngineStats:
        return sum_engine_stats([client.get_stats() for client in self.clients])

    def reset_prefix_cache(self) -> bool:
        """All cores or none: refused while any of them runs a request."""
        if self.has_unfinished_requests():
            logger.warning("reset_prefix_cache refused: requests are still running")
            return False
        for engine, client in enumerate(self.clients):
            if not client.reset_prefix_cache():
                return False
            self.router.forget_blocks(engine)
        return True

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()


def _kill_at_exit(client_ref: weakref.ref) -> None:
    client = client_ref()
    if client is not None:
        client.kill()


class MPClient:
    def __init__(self, args: EngineArgs, engine_index: int = 0) -> None:
        self._socket_dir = tempfile.TemporaryDirectory(prefix="pagedllm-")
        input_address = f"ipc://{os.path.join(self._socket_dir.name, 'input')}"
        output_address = f"ipc://{os.path.join(self._socket_dir.name, 'output')}"
        self.context = zmq.asyncio.Context()
        self.input_socket = self.context.socket(zmq.PUSH)
        self.input_socket.bind(input_address)
        self.output_socket = self.context.socket(zmq.PULL)
        self.output_socket.bind(output_address)
        # spawn, not fork: the API process may hold threads and an event loop.
        self.engine_index = engine_index
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(args, input_address, output_address, engine_index, os.getpid()),
            name=f"pagedllm-engine-core-{engine_index}",
            # Not a daemon: a daemonic process may not start children, and the core starts
            # its executor's worker processes (tensor/pipeline parallelism). It is killed at
            # exit all the same (below), before multiprocessing would wait for it.
            daemon=False,
        )
        self.process.start()
        atexit.register(_kill_at_exit, weakref.ref(self))
        self.dead = False
        self.closed = False
        # Kept apart from the process object, which `kill` closes (its pipes go with it).
        self._pid = self.process.pid

    @property
    def pid(self) -> int | None:
        return self._pid

    def _alive(self) -> bool:
        # A closed client's process was killed and reaped, and its object closed.
        return not self.closed and self.process.is_alive()

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        started = time.monotonic()
        event = await self.recv(timeout_s)
        if not isinstance(event, EngineReady):
            raise RuntimeError(f"engine core sent {type(event).__name__} before it was ready")
        logger.info(
            "Engine core %d (pid %d) ready in %.1f s",
            self.engine_index,
            event.pid,
            time.monotonic() - started,
        )

    async def send(self, message: EngineCoreInput) -> None:
        if self.dead or self.closed:
            raise EngineDeadError("the engine process is not running")
        try:
            await self.input_socket.send(input_encoder.encode(message), copy=False)
        except asyncio.CancelledError:
            # A send to a core that died waits (no peer is connected) until the restart
            # closes the socket, which cancels the send's future: the request must see the
            # core's death, as every other request in flight does. A cancelled stream would
            # end without its last chunk. The caller's own cancellation goes on as it is.
            task = asyncio.current_task()
            if self.closed and (task is None or not task.cancelling()):
                reason = "the engine process exited while a request was sent to it"
                raise EngineDeadError(reason) from None
            raise

    async def recv(self, timeout_s: float | None = None) -> EngineCoreEvent:
        """The next event from the core; EngineDeadError once its process is gone."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if await self.output_socket.poll(LIVENESS_POLL_MS):
                return event_decoder.decode(await self.output_socket.recv())
            if not self.process.is_alive():
                self.dead = True
                raise EngineDeadError(
                    f"the engine process exited with code {self.process.exitcode}"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine core did not answer in {timeout_s:.0f} s")

    async def events(self) -> AsyncIterator[EngineCoreEvent]:
        while True:
            yield await self.recv()

    def has_pending_events(self) -> bool:
        """Whether the core sent something not read yet (without reading it)."""
        if self.closed:
            return False
        return bool(self.output_socket.get(zmq.EVENTS) & zmq.POLLIN)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the core to exit; kill it if it does not within `timeout_s`."""
        if self._alive():
            with contextlib.suppress(EngineDeadError, TimeoutError):
                await asyncio.wait_for(self.send(Shutdown()), timeout_s)
            await asyncio.to_thread(self.process.join, timeout_s)
        self.kill()

    async def kill_now(self) -> None:
        """Kill the core (a dead or frozen one: SIGKILL ends a stopped process too) without
        blocking the event loop while it is reaped, then release the sockets."""
        if self._alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        self.kill()

    def kill(self) -> None:
        """Stop the core at once and release what it held here: the sockets, and the
        process object's pipes (its sentinel), closed now rather than whenever the object
        is collected, which a restart's exception tracebacks can put off."""
        if self.closed:
            return
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.closed = True
        self.process.close()
        self.context.destroy(linger=0)
        self._socket_dir.cleanup()
