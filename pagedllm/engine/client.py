"""Clients of the engine core: `InprocClient` (the core in this process, for `LLMEngine`) and
`MPClient` (the core in a process of its own, for the server's `AsyncLLM`).

Both send `EngineCoreRequest`s and aborts in and get `EngineCoreOutputs` back. `MPClient`
binds two IPC sockets (requests out, events in) and spawns the core, which connects to them.
Sends go through an asyncio ZMQ socket, so the event loop never blocks on the engine;
`events()` yields what the core reports and raises `EngineDeadError` when the process is gone.
An `MPClient` serves one core process: to restart the core, `AsyncLLM` kills it
(`kill_now`) and builds a new client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_proc import run_engine_core
from pagedllm.engine.messages import (
    EngineCoreEvent,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    Shutdown,
    event_decoder,
    input_encoder,
)
from pagedllm.errors import EngineDeadError
from pagedllm.metrics.stats import EngineStats

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


class MPClient:
    def __init__(self, args: EngineArgs) -> None:
        self._socket_dir = tempfile.TemporaryDirectory(prefix="pagedllm-")
        input_address = f"ipc://{os.path.join(self._socket_dir.name, 'input')}"
        output_address = f"ipc://{os.path.join(self._socket_dir.name, 'output')}"
        self.context = zmq.asyncio.Context()
        self.input_socket = self.context.socket(zmq.PUSH)
        self.input_socket.bind(input_address)
        self.output_socket = self.context.socket(zmq.PULL)
        self.output_socket.bind(output_address)
        # spawn, not fork: the API process may hold threads and an event loop.
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(args, input_address, output_address),
            name="pagedllm-engine-core",
            daemon=True,
        )
        self.process.start()
        self.dead = False
        self.closed = False

    @property
    def pid(self) -> int | None:
        return self.process.pid

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        started = time.monotonic()
        event = await self.recv(timeout_s)
        if not isinstance(event, EngineReady):
            raise RuntimeError(f"engine core sent {type(event).__name__} before it was ready")
        logger.info("Engine core (pid %d) ready in %.1f s", event.pid, time.monotonic() - started)

    async def send(self, message: EngineCoreInput) -> None:
        if self.dead or self.closed:
            raise EngineDeadError("the engine process is not running")
        await self.input_socket.send(input_encoder.encode(message), copy=False)

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
        if self.process.is_alive() and not self.closed:
            with contextlib.suppress(EngineDeadError, TimeoutError):
                await asyncio.wait_for(self.send(Shutdown()), timeout_s)
            await asyncio.to_thread(self.process.join, timeout_s)
        self.kill()

    async def kill_now(self) -> None:
        """Kill the core (a dead or frozen one: SIGKILL ends a stopped process too) without
        blocking the event loop while it is reaped, then release the sockets."""
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        self.kill()

    def kill(self) -> None:
        """Stop the core at once and release the sockets."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if not self.closed:
            self.closed = True
            self.context.destroy(linger=0)
            self._socket_dir.cleanup()
