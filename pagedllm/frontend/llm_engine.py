"""`LLMEngine`: the synchronous engine behind `LLM` — prompts in, `RequestOutput`s out.

It is the in-process client of the engine core: `InputProcessor` turns each prompt into an
`EngineCoreRequest`, `InprocClient` runs the core in this process, and `OutputProcessor`
turns the core's `EngineCoreOutputs` into `RequestOutput`s. With `data_parallel_size` N > 1,
`DPInprocClient` runs N cores in this process instead and routes each request to one.

Also the engine-level streaming API: `stream()` (a sync iterator) and `astream()` (an async
one) yield one request's outputs as the engine steps, while other requests go on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator

from pagedllm.client.core_client import DPInprocClient, InprocClient
from pagedllm.config import EngineArgs
from pagedllm.core.engine_config import load_engine_config
from pagedllm.core.engine_core import EngineCore
from pagedllm.core.messages import EngineCoreRequest
from pagedllm.frontend.output_processor import OutputProcessor
from pagedllm.frontend.processor import InputProcessor, PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.core.logger import StatLogger
from pagedllm.metrics.stats import EngineStats
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        started = time.monotonic()
        source, self.tokenizer, self.config = load_engine_config(args)
        self.model_config = self.config.model_config
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        num_engines = self.config.parallel_config.data_parallel_size
        self.engine_core_client: InprocClient | DPInprocClient
        if num_engines == 1:
            self.engine_core_client = InprocClient(self.config, self.tokenizer)
        else:
            self.engine_core_client = DPInprocClient(self.config, self.tokenizer, num_engines)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_logger = None if args.disable_log_stats else StatLogger()
        # Outputs waiting for a stream() / astream() consumer, per request id.
        self._stream_queues: dict[str, deque[RequestOutput]] = {}
        self._stream_ids = itertools.count()
        # Held by every change to the engine (add, step, abort): async consumers make those
        # changes from worker threads, and a step must never overlap another change.
        self._lock = threading.RLock()
        logger.info(
            "Loaded %s (%s) in %.1f s",
            source.path,
            self.model_config.architecture,
            time.monotonic() - started,
        )

    @property
    def engine_core(self) -> EngineCore:
        """The core this engine runs in-process (its scheduler and KV cache, for inspection);
        with data parallelism, the first one."""
        return self.engine_core_client.engine_core

    @property
    def engine_cores(self) -> list[EngineCore]:
        """Every core this engine runs (one per data-parallel rank)."""
        client = self.engine_core_client
        return client.engine_cores if isinstance(client, DPInprocClient) else [client.engine_core]

    # ---- requests in ----------------------------------------------------------------------
    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        tenant: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Tokenize and check one request (ValueError naming the field at fault)."""
        return self.input_processor.process_inputs(
            request_id,
            prompt,
            params,
            priority,
            tenant=tenant,
            lora_request=lora_request,
            pooling_params=pooling_params,
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        tenant: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate, tokenize and queue one request (raises ValueError on bad input)."""
        self.add_processed_request(
            *self.process_inputs(
                request_id, prompt, params, priority, tenant=tenant, lora_request=lora_request
            )
        )

    def add_processed_request(self, prompt_text: str | None, request: EngineCoreRequest) -> None:
        """Queue a request `process_inputs` built."""
        with self._lock:
            self.output_processor.add_request(request, prompt_text)
            self.engine_core_client.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self.engine_core_client.abort_requests(self.output_processor.family(request_id))
                final = self.output_processor.abort(request_id)
                if final is not None and request_id in self._stream_queues:
                    self._stream_queues[request_id].append(final)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core_client.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        return self.engine_core_client.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core_client.reset_prefix_cache()

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs it produced (per each request's output_kind)."""
        with self._lock:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core_client.get_output()
        if self.stat_logger is not None:
            self.stat_logger.record(core_outputs)
        outputs, stopped = self.output_processor.process(core_outputs.outputs)
        if stopped:  # finished by a stop string: the core must let go of them now
            self.engine_core_client.abort_requests(stopped)
        for output in outputs:
            queue = self._stream_queues.get(output.request_id)
            if queue is not None:
                queue.append(output)
        return outputs

    # ---- streaming ------------------------------------------------------------------------
    def stream(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Iterator[RequestOutput]:
        """Add a request and yield its outputs as they come; other requests keep running."""
        request_id, queue = self._open_stream(prompt, params, request_id, priority)
        try:
            while True:
                ready, done = _pop_ready(queue)
                yield from ready
                if done:
                    return
                self.step()
        finally:
            self._close_stream(request_id)

    async def astream(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """`stream()` for asyncio: adding, stepping and aborting run in worker threads under
        the engine lock, so concurrent consumers (in any event loop) take turns, and one that is
        cancelled mid-step aborts its request only after that step is done."""
        request_id, queue = await asyncio.to_thread(
            self._open_stream, prompt, params, request_id, priority
        )
        try:
            while True:
                ready, done = _pop_ready(queue)
                for output in ready:
                    yield output
                if done:
                    return
                await asyncio.to_thread(self._step_unless_ready, queue)
        finally:
            await asyncio.to_thread(self._close_stream, request_id)

    def _step_unless_ready(self, queue: deque[RequestOutput]) -> None:
        with self._lock:
            if not queue:  # another consumer's step may have produced our output meanwhile
                self._step()

    def _open_stream(self, prompt, params, request_id, priority):
        request_id = request_id or f"stream-{next(self._stream_ids)}"
        self.add_request(request_id, prompt, params, priority)
        queue: deque[RequestOutput] = deque()
        self._stream_queues[request_id] = queue
        return request_id, queue

    def _close_stream(self, request_id: str) -> None:
        """A consumer that stops early (or disconnects) aborts its request and, when n > 1,
        every sample still running (aborting finished ones does nothing)."""
        self.abort_request([request_id])
        self._stream_queues.pop(request_id, None)


def _pop_ready(queue: deque[RequestOutput]) -> tuple[list[RequestOutput], bool]:
    """The outputs waiting in a stream's queue, and whether the last one ends the request."""
    ready = []
    while queue:
        ready.append(queue.popleft())
        if ready[-1].finished:
            return ready, True
    return ready, False
