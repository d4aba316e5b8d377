"""`AsyncLLM`: the server's engine — the API-process half of a two-process engine.

It owns what runs next to HTTP: the tokenizer, validation (`InputProcessor`, which builds
the `EngineCoreRequest`), and output processing (detokenization, stop strings, logprob
text). The scheduler and the model run in the engine-core process behind `MPClient`. Each
request gets an asyncio queue; one task reads the core's events and fans them out, so the
event loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from pagedllm.config import EngineArgs
from pagedllm.engine.client import MPClient
from pagedllm.engine.engine_config import load_engine_config
from pagedllm.engine.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import InputProcessor, PromptType
from pagedllm.errors import EngineDeadError, InvalidRequestError
from pagedllm.metrics.stats import EngineStats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


class StepObserver(Protocol):
    """Sees every request and step (the Prometheus metrics implement it)."""

    def on_request_added(self, request_id: str, arrival_time: float, num_prompt: int) -> None: ...

    def on_step(
        self, outputs: list[EngineCoreOutput], stopped: list[str], stats: EngineStats, now: float
    ) -> None: ...

    def on_request_aborted(self, request_ids: list[str], now: float) -> None: ...


class AsyncLLM:
    def __init__(self, args: EngineArgs) -> None:
        # The core process loads its own config and the model while this one loads the
        # same config and the tokenizer: the two start-ups overlap.
        self.client = MPClient(args)
        try:
            _, self.tokenizer, self.config = load_engine_config(args, log=False)
        except Exception:
            self.client.kill()
            raise
        self.model_config = self.config.model_config
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.observers: list[StepObserver] = []
        self.dead_error: EngineDeadError | None = None
        self.on_dead: list[Callable[[], None]] = []  # called once the engine process is gone
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        # Requests that have not produced a token yet: the server's queue-depth limit.
        self._awaiting_first_token: set[str] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._output_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Wait for the engine core to load the model, then start reading its outputs."""
        await self.client.wait_ready()
        self._output_task = asyncio.create_task(self._handle_events())

    @property
    def num_queued_requests(self) -> int:
        return len(self._awaiting_first_token)

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def process_inputs(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> tuple[str | None, EngineCoreRequest]:
        """Tokenize and check one request (`InvalidRequestError` naming the field at fault);
        call it before answering, so bad input is refused before any output is streamed."""
        return self.input_processor.process_inputs(request_id, prompt, params, priority)

    async def generate(
        self, prompt_text: str | None, request: EngineCoreRequest
    ) -> AsyncIterator[RequestOutput]:
        """Run one request `process_inputs` built; yields its outputs (per its output_kind).

        A consumer that stops early (a client disconnect cancels it) aborts the request in
        the core at once, which frees its KV blocks.
        """
        if self.dead_error is not None:
            raise self.dead_error
        request_id = request.request_id
        if request_id in self._queues:
            raise InvalidRequestError(f"request_id {request_id!r} is already running", "request_id")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(request, prompt_text)
        self._awaiting_first_token.add(request_id)
        for observer in self.observers:
            observer.on_request_added(
                request_id, request.arrival_time, len(request.prompt_token_ids)
            )
        finished = False
        try:
            await self.client.send(request)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Forget the request here and tell the core to drop it (and its n > 1 samples)."""
        family = self.output_processor.family(request_id)
        self.output_processor.abort(request_id)
        self._awaiting_first_token.discard(request_id)
        for observer in self.observers:
            observer.on_request_aborted(family, time.monotonic())
        if not self.is_dead:
            self._send_in_background(AbortRequests(family))

    def _send_in_background(self, message: AbortRequests) -> None:
        task = asyncio.get_running_loop().create_task(self.client.send(message))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _handle_events(self) -> None:
        try:
            async for event in self.client.events():
                if isinstance(event, EngineCoreOutputs):
                    self._process_outputs(event)
        except EngineDeadError as error:
            logger.error("Engine core died: %s", error)
            self._fail_all(error)
        except Exception as error:  # a bug here must not leave requests hanging
            logger.exception("Output handler failed")
            self._fail_all(EngineDeadError(f"output handler failed: {error}"))

    def _process_outputs(self, event: EngineCoreOutputs) -> None:
        now = time.monotonic()
        outputs, stopped = self.output_processor.process(event.outputs)
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
        for core_output in event.outputs:
            if core_output.new_token_ids:
                self._awaiting_first_token.discard(core_output.request_id)
        if stopped:  # finished by a stop string: the core must let go of them now
            self._send_in_background(AbortRequests(stopped))
        for observer in self.observers:
            observer.on_step(event.outputs, stopped, event.stats, now)

    def _fail_all(self, error: EngineDeadError) -> None:
        self.dead_error = error
        for queue in self._queues.values():
            queue.put_nowait(error)
        for callback in self.on_dead:
            callback()

    async def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        await self.client.shutdown()
