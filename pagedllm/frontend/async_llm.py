"""`AsyncLLM`: the server's engine — the API-process half of a two-process engine.

It owns what runs next to HTTP: the tokenizer, validation (`InputProcessor`, which builds
the `EngineCoreRequest`), and output processing (detokenization, stop strings, logprob
text). The scheduler and the model run in the engine-core process behind `MPClient`. Each
request gets an asyncio queue; one task reads the core's events and fans them out, so the
event loop never waits on the model.

Data parallelism (`data_parallel_size` N > 1): N engine-core processes, one `MPClient` and
one output task each; `DPRouter` picks each request's core (the one holding most of its
prompt's prefix unless it is clearly busier, else the least loaded) and remembers it, so
aborts go to that core alone. N = 1 takes none of that path: no hashing, no routing.

Supervision, per core: a watchdog task reports a core that owes outputs (requests it has not
finished) and sends none for `iteration_timeout_s` as stalled (`unavailable_reason`,
`on_stalled`); a core that exits, or stalls, ends the requests in flight on it with
`EngineDeadError`. With `restart_on_failure` it is then killed and replaced by a new core (a
new `MPClient`) and new requests are served again; a new core that is not ready within the
restart deadline (`restart_timeout_given_s`, else `startup_timeout_s`, else one derived from
the first start's time), stopped or too slow, is killed and started again, up to
`restart_attempts` times with a growing pause between them, and then the engine is dead.
Without `restart_on_failure` the engine stays dead (`on_dead`: every request fails, whichever
core it ran on), and a stalled core stays reported until it sends something again. While any
core is stalled or restarting the engine is unavailable (/health 503). `fail_all_requests`
ends what is running with an error of the server's choosing (a drain that ran out of time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from pagedllm.client.core_client import MPClient
from pagedllm.client.dp_router import DPRouter, routing_policy_from_env
from pagedllm.config import EngineArgs
from pagedllm.core.engine_config import load_engine_config
from pagedllm.core.messages import (
    DEFAULT_TENANT,
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from pagedllm.core.request import family_id
from pagedllm.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from pagedllm.frontend.admission import AdmissionQueue, Cost, QueueLimits, Reservation
from pagedllm.frontend.output_processor import OutputProcessor
from pagedllm.frontend.processor import InputProcessor, PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.stats import EngineStats
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")

# How often the watchdog looks for a stalled core.
WATCHDOG_INTERVAL_S = 0.5
# The first start's deadline when none is given: vLLM's VLLM_ENGINE_READY_TIMEOUT_S.
FIRST_START_TIMEOUT_S = 600.0
# A restart loads the same model on the same host as the first start did: without a deadline
# of its own it gets this many times the first start's time (a busy host, a cold page cache),
# and never less than the floor (a first start of a few seconds says little).
RESTART_TIMEOUT_FACTOR = 3.0
MIN_RESTART_TIMEOUT_S = 60.0
DEFAULT_RESTART_ATTEMPTS = 3
# The pause before a restart's second start attempt, doubled before each further one (a
# host short of memory or a device still being released gets time), up to the cap.
RESTART_BACKOFF_S = 1.0
MAX_RESTART_BACKOFF_S = 30.0


class StepObserver(Protocol):
    """Sees every request and step (the Prometheus metrics implement it)."""

    def on_request_added(
        self, request_id: str, arrival_time: float, num_prompt: int, tenant: str
    ) -> None: ...

    def on_step(
        self,
        outputs: list[EngineCoreOutput],
        stopped: list[str],
        stats: EngineStats,
        now: float,
        engine_index: int = 0,
    ) -> None: ...

    def on_request_aborted(self, request_ids: list[str], now: float) -> None: ...


class _Core:
    """One engine-core process as `AsyncLLM` supervises it."""

    def __init__(self, index: int, client: MPClient) -> None:
        self.index = index
        self.client = client
        self.output_task: asyncio.Task[None] | None = None
        self.restart_task: asyncio.Task[None] | None = None
        self.last_progress = time.monotonic()
        self.stalled_since: float | None = None  # time.monotonic() of its last output
        self.start_attempt = 0  # while restarting: which attempt at starting a new core


class CoreStartFailed(Exception):
    """Every attempt at starting a core in place of a failed one failed."""


class AsyncLLM:
    def __init__(self, args: EngineArgs) -> None:
        # The core processes load their own config and the model while this one loads the
        # same config and the tokenizer: the start-ups overlap.
        self.args = args  # kept to start a new core after a failure
        self._created = time.monotonic()
        self.first_start_s: float | None = None  # how long the first start took
        self.cores: list[_Core] = []
        try:
            for index in range(args.data_parallel_size):
                self.cores.append(_Core(index, MPClient(args, index)))
            _, self.tokenizer, self.config = load_engine_config(args, log=False)
        except Exception:
            for core in self.cores:
                core.client.kill()
            raise
        # Data parallelism only: which core runs each request (None: the one core).
        self.router: DPRouter | None = None
        if len(self.cores) > 1:
            cache_config = self.config.cache_config
            self.router = DPRouter(
                len(self.cores), cache_config.num_blocks, routing_policy_from_env()
            )
        self.model_config = self.config.model_config
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.observers: list[StepObserver] = []
        self.dead_error: EngineDeadError | None = None
        self.on_dead: list[Callable[[], None]] = []  # called once the engine process is gone
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        # Requests that have not produced a token yet: the server's admission limits.
        self.admission = AdmissionQueue()
        self._background: set[asyncio.Task[Any]] = set()
        # Supervision, set by the server. A core that owes outputs and sends nothing for
        # this long is stalled (None: never); a failed core is replaced when asked to.
        self.iteration_timeout_s: float | None = None
        self.restart_on_failure = False
        self.num_restarts = 0
        # Seconds a core may take to be ready (None: FIRST_START_TIMEOUT_S for the first start,
        # `restart_timeout_s` for a restart), a restarted core's own deadline (None: the rule
        # of `restart_timeout_s`), and start attempts per restart.
        self.startup_timeout_s: float | None = None
        self.restart_timeout_given_s: float | None = None
        self.restart_attempts = DEFAULT_RESTART_ATTEMPTS
        # (core index, True when stalled / False after) and (core index) after a restart.
        self.on_stalled: list[Callable[[int, bool], None]] = []
        self.on_restarted: list[Callable[[int], None]] = []
        self._watchdog_task: asyncio.Task[None] | None = None
        self._stopping = False  # shutting down: a failure is not repaired any more
        self._refusal: Exception | None = None  # what new requests get after a drain

    async def start(self) -> None:
        """Wait for the engine cores to load the model, then start reading their outputs."""
        timeout = self.startup_timeout_s or FIRST_START_TIMEOUT_S
        try:
            await asyncio.gather(*(core.client.wait_ready(timeout) for core in self.cores))
        except TimeoutError:  # the caller's shutdown kills the cores
            raise TimeoutError(
                f"the engine core was not ready within {timeout:.0f} s (--engine-startup-timeout)"
            ) from None
        self.first_start_s = time.monotonic() - self._created
        for core in self.cores:
            self._start_reading(core)
        self._watchdog_task = asyncio.create_task(self._watch())

    def _start_reading(self, core: _Core) -> None:
        core.last_progress = time.monotonic()
        core.output_task = asyncio.create_task(self._handle_events(core))

    @property
    def restart_timeout_s(self) -> float:
        """The deadline of a restarted core's start: the restart's own, else the start-up
        deadline given, else derived from the first start's time."""
        if self.restart_timeout_given_s is not None:
            return self.restart_timeout_given_s
        if self.startup_timeout_s is not None:
            return self.startup_timeout_s
        if self.first_start_s is None:
            return FIRST_START_TIMEOUT_S
        return max(MIN_RESTART_TIMEOUT_S, RESTART_TIMEOUT_FACTOR * self.first_start_s)

    @property
    def client(self) -> MPClient:
        """The first core's client (the only one without data parallelism)."""
        return self.cores[0].client

    @property
    def stalled_since(self) -> float | None:
        """Since when the longest-stalled core has sent nothing (None: none is stalled)."""
        stalled = [core.stalled_since for core in self.cores if core.stalled_since is not None]
        return min(stalled) if stalled else None

    @property
    def num_queued_requests(self) -> int:
        """Engine requests (each counting its n samples) waiting for their first token."""
        return self.admission.num_requests

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens of the requests waiting for their first token."""
        return self.admission.num_tokens

    def admit(self, requests: list[EngineCoreRequest], limits: QueueLimits) -> Reservation:
        """Queue all of one HTTP request's engine requests or none (`QueueFullError`); release
        the reservation when their streams end."""
        for request in requests:
            request_id = request.request_id
            if request_id in self._queues or request_id in self.admission:
                raise InvalidRequestError(
                    f"request_id {request_id!r} is already running", "request_id"
                )
        costs = {request.request_id: _cost(request) for request in requests}
        return self.admission.admit(costs, limits)

    @property
    def is_dead(self) -> bool:
        """The engine cannot take requests now (`unavailable_reason` says why): the server
        answers 503 on /health and to new requests."""
        return self.unavailable_reason is not None

    @property
    def unavailable_reason(self) -> str | None:
        if self.dead_error is not None:
            return f"the engine is not running: {self.dead_error}"
        for core in self.cores:  # data parallel: the reason names the core
            which = f" (engine core {core.index})" if self.router is not None else ""
            if core.restart_task is not None:
                attempt = f"start attempt {core.start_attempt} of {self.restart_attempts}"
                return f"the engine is restarting after a failure ({attempt}){which}"
            if core.stalled_since is not None:
                stalled_for = time.monotonic() - core.stalled_since
                return f"the engine has made no progress for {stalled_for:.0f} s{which}"
        return None

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
        """Tokenize and check one request (`InvalidRequestError` naming the field at fault);
        call it before answering, so bad input is refused before any output is streamed."""
        return self.input_processor.process_inputs(
            request_id,
            prompt,
            params,
            priority,
            tenant=tenant,
            lora_request=lora_request,
            pooling_params=pooling_params,
        )

    async def generate(
        self, prompt_text: str | None, request: EngineCoreRequest
    ) -> AsyncIterator[RequestOutput]:
        """Run one request `process_inputs` built; yields its outputs (per its output_kind).

        A consumer that stops early (a client disconnect cancels it) aborts the request in
        the core at once, which frees its KV blocks.
        """
        await self._wait_for_a_core()  # admitted just before a core failed
        # Raised afresh each time: the traceback of one request must not pile onto another's.
        if self._refusal is not None:
            raise self._refusal.with_traceback(None)
        if self.dead_error is not None:
            raise self.dead_error.with_traceback(None)
        request_id = request.request_id
        if request_id in self._queues:
            raise InvalidRequestError(f"request_id {request_id!r} is already running", "request_id")
        core = self.cores[0] if self.router is None else self._route(request)
        # Who it runs for, as the serving layer named it (None: the default tenant).
        tenant = DEFAULT_TENANT if request.tenant is None else request.tenant
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(request, prompt_text)
        self.admission.add(request_id, _cost(request))
        for observer in self.observers:
            observer.on_request_added(
                request_id, request.arrival_time, len(request.prompt_token_ids), tenant
            )
        finished = core_lost = False
        try:
            try:
                await core.client.send(request)
            except EngineDeadError:
                core_lost = True  # it never reached a core that lives: nothing to abort
                raise
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    # A request that failed in the engine was let go of already; one the
                    # core lost (it died) is forgotten here alone; one the server ended (a
                    # drain out of time) is aborted in the core too.
                    finished = isinstance(item, RequestFailedError)
                    core_lost = isinstance(item, EngineDeadError)
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self.admission.release(request_id)
            if not finished:
                self.abort(request_id, tell_core=not core_lost)

    async def _wait_for_a_core(self) -> None:
        """Wait while every core is restarting (one core: while it restarts)."""
        while True:
            restarts = [core.restart_task for core in self.cores]
            if any(task is None for task in restarts):
                return
            await asyncio.shield(restarts[0])  # type: ignore[arg-type]

    def _route(self, request: EngineCoreRequest) -> _Core:
        """Data parallel: the core for this request, among those not restarting."""
        assert self.router is not None
        block_size = self.config.cache_config.block_size
        restarting = [core.index for core in self.cores if core.restart_task is not None]
        return self.cores[self.router.route_request(request, block_size, restarting)]

    def abort(self, request_id: str, tell_core: bool = True) -> None:
        """Forget the request here and tell the core to drop it (and its n > 1 samples)."""
        family = self.output_processor.family(request_id)
        self.output_processor.abort(request_id)
        self.admission.release(request_id)
        for observer in self.observers:
            observer.on_request_aborted(family, time.monotonic())
        if self.router is None:
            if tell_core and self.dead_error is None:
                self._send_in_background(self.cores[0], AbortRequests(family))
            return
        by_core = self.router.finish_all(family)  # those its cores have not finished yet
        if tell_core and self.dead_error is None:
            for index, member_ids in by_core.items():
                self._send_in_background(self.cores[index], AbortRequests(member_ids))

    def _send_in_background(self, core: _Core, message: AbortRequests) -> None:
        task = asyncio.get_running_loop().create_task(self._send_quietly(core, message))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_quietly(self, core: _Core, message: AbortRequests) -> None:
        # The core may be gone, or being replaced, by the time this runs: nothing to abort.
        with contextlib.suppress(EngineDeadError):
            await core.client.send(message)

    async def _handle_events(self, core: _Core) -> None:
        try:
            async for event in core.client.events():
                core.last_progress = time.monotonic()
                if core.stalled_since is not None:
                    stalled_for = core.last_progress - core.stalled_since
                    logger.warning(
                        "Engine core%s made progress again after %.1f s",
                        self._which(core),
                        stalled_for,
                    )
                    self._set_stalled(core, None)
                if isinstance(event, EngineCoreOutputs):
                    self._process_outputs(core, event)
        except EngineDeadError as error:
            logger.error("Engine core%s died: %s", self._which(core), error)
            self._on_core_failure(core, error)
        except Exception as error:  # a bug here must not leave requests hanging
            logger.exception("Output handler failed")
            self._fail_all(EngineDeadError(f"output handler failed: {error}"))

    def _process_outputs(self, core: _Core, event: EngineCoreOutputs) -> None:
        now = time.monotonic()
        outputs, stopped = self.output_processor.process(event.outputs)
        failed = []
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if output.error is not None:
                # It failed alone in the engine (fault isolation): its consumer gets the error
                # (a 500, or an error event in a stream); the core goes on with the others.
                failed.append(output.request_id)
                if queue is not None:
                    queue.put_nowait(RequestFailedError(output.request_id, output.error))
            elif queue is not None:
                queue.put_nowait(output)
        for core_output in event.outputs:
            if core_output.new_token_ids:
                self.admission.first_token(core_output.request_id)
            elif core_output.finished:  # finished without a token (an error, say)
                self.admission.release(core_output.request_id)
        if self.router is not None:
            self.router.finish_outputs(event.outputs)
            self.router.finish_all(stopped)
        if stopped:  # finished by a stop string: the core must let go of them now
            self._send_in_background(core, AbortRequests(stopped))
        for observer in self.observers:
            observer.on_step(event.outputs, stopped, event.stats, now, core.index)
        for request_id in failed:  # its other samples (n > 1) stop; its queue slot is freed
            self.abort(request_id)

    # ---- supervision ------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Report a core that owes outputs and has sent none for `iteration_timeout_s`."""
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            for core in self.cores:
                if core.restart_task is None:  # a core being replaced owes nothing
                    self._check_progress(core, time.monotonic())

    def _check_progress(self, core: _Core, now: float) -> None:
        timeout = self.iteration_timeout_s
        # The core owes outputs to every request it has not finished (a slow reader of a
        # finished one does not count).
        if self.router is None:
            num_owed = len(self.output_processor.states)
        else:
            num_owed = self.router.loads[core.index]
        if timeout is None or not num_owed:
            core.last_progress = now
            return
        if core.stalled_since is not None or now - core.last_progress <= timeout:
            return
        # Outputs not read yet mean this event loop was busy, not the core. (Asked only
        # here: reading the socket's state can delay the output task's next wake-up.)
        if core.client.has_pending_events():
            core.last_progress = now
            return
        message = (
            f"the engine core{self._which(core)} (pid {core.client.pid}) made no progress for "
            f"{now - core.last_progress:.1f} s with {num_owed} request(s) unfinished"
        )
        logger.error("Engine core stalled: %s", message)
        self._set_stalled(core, core.last_progress)
        if self.restart_on_failure and not self._stopping:  # a drain deals with it
            self._on_core_failure(core, EngineDeadError(message))

    def _which(self, core: _Core) -> str:
        """How log lines name a core: by its index with data parallelism, else not at all."""
        return "" if self.router is None else f" {core.index}"

    def _set_stalled(self, core: _Core, since: float | None) -> None:
        core.stalled_since = since
        for callback in self.on_stalled:
            callback(core.index, since is not None)

    def _on_core_failure(self, core: _Core, error: EngineDeadError) -> None:
        """A core exited or stalled: restart it if asked to, else the engine is dead."""
        if not self.restart_on_failure or self._stopping:
            self._fail_all(error)
        elif core.restart_task is None:
            core.restart_task = asyncio.create_task(self._restart(core, error))

    def _fail_core_requests(self, core: _Core, error: EngineDeadError) -> None:
        """End the requests in flight on this core (all of them: one core) and forget them now,
        not when their handlers get to it: the new core owes them nothing."""
        if self.router is None:
            lost = list(self._queues)
        else:  # a request's samples all run on its core: their parent ids
            lost = sorted({family_id(rid) for rid in self.router.forget_engine(core.index)})
        for request_id in lost:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(error)
            self.output_processor.abort(request_id)

    async def _restart(self, core: _Core, error: EngineDeadError) -> None:
        """End what is in flight on the core, kill it, start a new one and serve again."""
        old, started = core.client, time.monotonic()
        logger.error("Restarting the engine core%s (pid %s): %s", self._which(core), old.pid, error)
        self._fail_core_requests(core, error)
        if core.output_task is not None:
            core.output_task.cancel()
        await old.kill_now()
        try:
            await self._start_new_core(core)
        except CoreStartFailed as start_error:
            core.restart_task = None
            self._fail_all(EngineDeadError(f"restarting the engine failed: {start_error}"))
            return
        self.num_restarts += 1
        if core.stalled_since is not None:
            self._set_stalled(core, None)
        core.restart_task = None
        self._start_reading(core)
        logger.warning(
            "Engine core%s restarted (pid %s, restart %d, in %.1f s)",
            self._which(core),
            core.client.pid,
            self.num_restarts,
            time.monotonic() - started,
        )
        for callback in self.on_restarted:
            callback(core.index)

    async def _start_new_core(self, core: _Core) -> None:
        """Start a core in place of a failed one: `restart_attempts` tries, each killed if not
        ready within `restart_timeout_s` (a stopped core never is), with a growing pause
        between them; `CoreStartFailed` (logged for the operator) when all failed."""
        timeout, attempts = self.restart_timeout_s, self.restart_attempts
        for attempt in range(1, attempts + 1):
            core.start_attempt = attempt
            try:
                await self._start_core_once(core, timeout)
                return
            except Exception as error:
                reason = _start_failure(error, timeout)
            if attempt == attempts:
                self._log_giving_up(core, attempts, reason, timeout)
                raise CoreStartFailed(f"{attempts} start attempt(s) failed, the last: {reason}")
            pause = min(MAX_RESTART_BACKOFF_S, RESTART_BACKOFF_S * 2 ** (attempt - 1))
            logger.error(
                "Engine core%s start attempt %d of %d failed: %s; trying again in %.0f s",
                self._which(core),
                attempt,
                attempts,
                reason,
                pause,
            )
            await asyncio.sleep(pause)

    def _log_giving_up(self, core: _Core, attempts: int, reason: str, timeout_s: float) -> None:
        # The line an operator reads when the server has exited: what failed, and what to do.
        logger.error(
            "Engine core%s start attempt %d of %d failed: %s. Giving up: the server exits. "
            "The engine core's log above says why it did not start; if it was only slow, "
            "raise %s (now %.0f s).",
            self._which(core),
            attempts,
            attempts,
            reason,
            self.restart_timeout_flag,
            timeout_s,
        )

    @property
    def restart_timeout_flag(self) -> str:
        """The server flag that sets a restart's deadline now, for the operator to raise."""
        if self.restart_timeout_given_s is not None:
            return "--engine-restart-timeout"
        return "--engine-startup-timeout"

    async def _start_core_once(self, core: _Core, timeout_s: float) -> None:
        """One new core, ready within `timeout_s`; one that is not is killed before this
        raises (SIGKILL ends a stopped process too), so no attempt leaves a process behind."""
        try:
            core.client = MPClient(self.args, core.index)
            await core.client.wait_ready(timeout_s)
        except asyncio.CancelledError:  # shutdown while the new core loads
            core.client.kill()
            raise
        except Exception:
            await core.client.kill_now()
            raise

    def fail_all_requests(self, error: Exception) -> int:
        """End every running request with `error` and refuse new ones with it (a drain that
        ran out of time): each handler answers with it. Returns how many were running."""
        self._stopping = True
        self._refusal = error
        return self._fail_requests(error)

    def begin_shutdown(self) -> None:
        """The server is draining: a core failure from now on is not repaired."""
        self._stopping = True

    def _fail_requests(self, error: BaseException) -> int:
        for queue in self._queues.values():
            queue.put_nowait(error)
        return len(self._queues)

    def _fail_all(self, error: EngineDeadError) -> None:
        self.dead_error = error
        self.admission.clear()
        self._fail_requests(error)
        for callback in self.on_dead:
            callback()

    async def shutdown(self) -> None:
        self._stopping = True
        tasks = [self._watchdog_task]
        for core in self.cores:
            tasks += [core.restart_task, core.output_task]
        for task in tasks:
            if task is not None:
                task.cancel()
        for core in self.cores:
            if core.restart_task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await core.restart_task
        await asyncio.gather(*(core.client.shutdown() for core in self.cores))


def _start_failure(error: Exception, timeout_s: float) -> str:
    """Why a start attempt failed, in words for the log and the error requests get."""
    if isinstance(error, TimeoutError):
        return f"the new core was not ready within {timeout_s:.0f} s (stopped or too slow)"
    return str(error) or type(error).__name__


def _cost(request: EngineCoreRequest) -> Cost:
    # n samples fork after one prefill: each counts as a request, the prompt once.
    return Cost(request.sampling_params.n, len(request.prompt_token_ids))
