"""`StructuredOutputManager`: the engine core's side of structured output.

Grammars compile in a worker thread, once per distinct spec (an LRU of compiled grammars),
so a request whose grammar is still compiling waits in the queue while others run. A
compile may run `compile_timeout_s`; past that the requests waiting for it end with an
error, and the compiles queued behind it move to a fresh thread (the spec's size and depth
are bounded before it is queued, `validation.py`; its compile time only here). Each step
the scheduler asks for one bitmask covering every constrained request that samples; after
sampling, each such request's matcher accepts its token, and a completed grammar ends the
request. Requests without a spec never touch any of this.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.core.request import Request
from pagedllm.sample.grammar_bitmask import bitmask_words
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import GrammarMatcher
from pagedllm.structured_output.registry import create_backend

logger = logging.getLogger("pagedllm")

MAX_CACHED_GRAMMARS = 256
# How long one grammar may compile before the requests waiting for it end with an error.
# Large legitimate schemas compile in a few seconds on a CPU.
GRAMMAR_COMPILE_TIMEOUT_S = 30.0
# Compiles cannot be interrupted: one past its time limit keeps its thread until it ends,
# and the compiles queued behind it move to a fresh thread. At most this many threads are
# left behind at a time; beyond that compiles queue behind the stuck one, and a request
# queued for longer than the time limit ends with the same error.
MAX_ABANDONED_COMPILES = 2


@dataclass
class RequestGrammar:
    """One request's grammar: compiling (future), ready (matcher) or failed (error)."""

    future: Future
    matcher: GrammarMatcher | None = None
    error: str | None = None
    # time.monotonic() past which the request stops waiting while its compile is queued
    # behind a stuck one (once running, the compile's own start counts).
    deadline: float = float("inf")


def spec_key(spec: StructuredOutputsParams) -> str:
    return json.dumps(dataclasses.asdict(spec), sort_keys=True)


class CompileFuture(Future):
    """A compile's future, with when it started running (None while queued)."""

    started_at: float | None = None


class CompileThread:
    """One daemon thread running compiles in order. Daemon, unlike a ThreadPoolExecutor's
    threads (joined at exit), so a compile past its time limit never holds up the exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.current: CompileFuture | None = None  # the compile running now

    def submit(self, fn: Callable[..., Any], *args: Any) -> CompileFuture:
        future = CompileFuture()
        self._put((future, fn, args))
        return future

    def _put(self, job: tuple[CompileFuture, Callable[..., Any], tuple]) -> None:
        if self._thread is None:  # started at the first compile
            self._thread = threading.Thread(target=self._run, name="grammar", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            future.started_at = time.monotonic()
            self.current = future
            try:
                result = fn(*args)
            except BaseException as error:  # delivered to the requests waiting on it
                future.set_exception(error)
            else:
                future.set_result(result)
            self.current = None

    def hand_over(self, successor: CompileThread) -> None:
        """Move the queued compiles to `successor`; this thread ends after its current one."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            successor._put(job)
        self._jobs.put(None)

    def shutdown(self) -> None:
        while True:
            try:
                future, _, _ = self._jobs.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        self._jobs.put(None)


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        backend: str = "xgrammar",
        compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S,
    ) -> None:
        if not compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        self.compile_timeout_s = compile_timeout_s
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._backend_name = backend
        self._backend = None  # built at the first constrained request (imports xgrammar)
        self._compile_thread = CompileThread()
        self._compiled: OrderedDict[str, CompileFuture] = OrderedDict()
        # Compiles that ran past the time limit, each in a thread since replaced.
        self._abandoned: list[CompileFuture] = []

    def _get_backend(self):
        if self._backend is None:
            self._backend = create_backend(
                self._backend_name, self._tokenizer, self._vocab_size, self._eos_token_ids
            )
        return self._backend

    def add_request(self, request: Request) -> None:
        spec = request.sampling_params.structured_outputs
        if spec is None:
            return
        if self._tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer (skip_tokenizer_init is set)")
        deadline = time.monotonic() + self.compile_timeout_s
        request.structured_output = RequestGrammar(self._compile(spec), deadline=deadline)

    def _compile(self, spec: StructuredOutputsParams) -> CompileFuture:
        key = spec_key(spec)
        future = self._compiled.get(key)
        if future is None or future.cancelled() or (future.done() and future.exception()):
            backend = self._get_backend()
            future = self._compile_thread.submit(backend.compile, spec)
            self._compiled[key] = future
        self._compiled.move_to_end(key)
        while len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return future

    def is_ready(self, request: Request) -> bool:
        """False while the request's grammar compiles; then its matcher (or error) is set."""
        state: RequestGrammar | None = request.structured_output
        if state is None or state.matcher is not None or state.error is not None:
            return True
        if not state.future.done():
            now = time.monotonic()
            self._leave_stuck_compile(now)
            if not self._expired(state, now):
                return False
            state.error = (
                f"structured_outputs: the grammar did not compile within the time limit of "
                f"{self.compile_timeout_s:g} s"
            )
            logger.error("Request %s: %s", request.request_id, state.error)
            return True
        error = state.future.exception()
        if error is not None:
            state.error = str(error)
            logger.error("Request %s: grammar failed: %s", request.request_id, error)
        else:
            state.matcher = self._get_backend().matcher(state.future.result())
        return True

    def _expired(self, state: RequestGrammar, now: float) -> bool:
        started = getattr(state.future, "started_at", None)
        if started is not None:
            return now - started > self.compile_timeout_s
        # Queued: it moves to a fresh thread when the compile ahead is left behind, unless
        # too many already are.
        return now > state.deadline and len(self._abandoned) >= MAX_ABANDONED_COMPILES

    def _leave_stuck_compile(self, now: float) -> None:
        """A compile past the time limit holds its thread until it ends: the compiles queued
        behind it move to a fresh thread (while fewer than `MAX_ABANDONED_COMPILES` are left
        behind)."""
        self._abandoned = [future for future in self._abandoned if not future.done()]
        running = self._compile_thread.current
        if (
            running is None
            or running.started_at is None
            or now - running.started_at <= self.compile_timeout_s
            or len(self._abandoned) >= MAX_ABANDONED_COMPILES
        ):
            return
        self._abandoned.append(running)
        stuck, self._compile_thread = self._compile_thread, CompileThread()
        stuck.hand_over(self._compile_thread)

    def fork(self, parent: Request, child: Request) -> None:
        """A parallel sample starts from the grammar's initial state, as its parent did."""
        state: RequestGrammar | None = parent.structured_output
        if state is not None:
            child.structured_output = RequestGrammar(state.future)
            self.is_ready(child)

    def bitmask(
        self, requests: list[Request], drafts: dict[str, list[int]] | None = None
    ) -> tuple[torch.Tensor, dict[str, int]] | None:
        """The next-token bitmask of every constrained request in `requests` (all of which
        sample this step), and each one's first row in it; None when none is constrained.

        A request verifying drafts (`drafts`, speculative decoding) has one row more per
        draft, consecutive: row i is what the grammar allows after its first i drafts (the
        matcher advances through them, then rolls back)."""
        drafts = drafts or {}
        constrained = [r for r in requests if r.structured_output is not None]
        if not constrained:
            return None
        num_rows = sum(1 + len(drafts.get(r.request_id, ())) for r in constrained)
        bitmask = torch.full((num_rows, bitmask_words(self._vocab_size)), -1, dtype=torch.int32)
        rows = {}
        row = 0
        for request in constrained:
            rows[request.request_id] = row
            request_drafts = drafts.get(request.request_id, ())
            self._fill_rows(request.structured_output.matcher, request_drafts, bitmask, row)
            row += 1 + len(request_drafts)
        return bitmask, rows

    @staticmethod
    def _fill_rows(matcher, drafts, bitmask: torch.Tensor, row: int) -> None:
        if matcher is None:
            return
        num_accepted = 0
        for index in range(len(drafts) + 1):
            if matcher.is_terminated():
                break
            matcher.fill_bitmask(bitmask, row + index)
            if index == len(drafts) or not matcher.accept_token(drafts[index]):
                break
            num_accepted += 1
        if num_accepted:
            matcher.rollback(num_accepted)

    def valid_prefix(self, request: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the request's grammar accepts from its state, up to
        and including a token that completes it (the matcher is left as it was)."""
        matcher = request.structured_output.matcher
        if matcher is None:
            return []
        num_valid = 0
        for token_id in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            num_valid += 1
        if num_valid:
            matcher.rollback(num_valid)
        return drafts[:num_valid]

    def accept(self, request: Request, token_id: int) -> bool:
        """Advance the request's grammar; True if the grammar is now complete (or broken)."""
        matcher = request.structured_output.matcher
        if matcher is None or matcher.is_terminated():
            return matcher is not None
        if not matcher.accept_token(token_id):
            logger.error("Request %s: token %d broke its grammar", request.request_id, token_id)
            return True
        return matcher.is_terminated()

    def shutdown(self) -> None:
        self._compile_thread.shutdown()
