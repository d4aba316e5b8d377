"""`StructuredOutputManager`: the engine core's side of structured output.

Grammars compile in a worker thread, once per distinct spec (an LRU of compiled grammars),
so a request whose grammar is still compiling waits in the queue while others run. Each
step the scheduler asks for one bitmask covering every constrained request that samples;
after sampling, each such request's matcher accepts its token, and a completed grammar
ends the request. Requests without a spec never touch any of this.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
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


@dataclass
class RequestGrammar:
    """One request's grammar: compiling (future), ready (matcher) or failed (error)."""

    future: Future
    matcher: GrammarMatcher | None = None
    error: str | None = None


def spec_key(spec: StructuredOutputsParams) -> str:
    return json.dumps(dataclasses.asdict(spec), sort_keys=True)


class StructuredOutputManager:
    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], backend: str = "xgrammar"
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._backend_name = backend
        self._backend = None  # built at the first constrained request (imports xgrammar)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiled: OrderedDict[str, Future] = OrderedDict()

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
        request.structured_output = RequestGrammar(self._compile(spec))

    def _compile(self, spec: StructuredOutputsParams) -> Future:
        key = spec_key(spec)
        future = self._compiled.get(key)
        if future is None or (future.done() and future.exception() is not None):
            backend = self._get_backend()
            future = self._executor.submit(backend.compile, spec)
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
            return False
        error = state.future.exception()
        if error is not None:
            state.error = str(error)
            logger.error("Request %s: grammar failed: %s", request.request_id, error)
        else:
            state.matcher = self._get_backend().matcher(state.future.result())
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """A parallel sample starts from the grammar's initial state, as its parent did."""
        state: RequestGrammar | None = parent.structured_output
        if state is not None:
            child.structured_output = RequestGrammar(state.future)
            self.is_ready(child)

    def bitmask(self, requests: list[Request]) -> tuple[torch.Tensor, dict[str, int]] | None:
        """The next-token bitmask of every constrained request in `requests` (all of which
        sample this step), and each one's row in it; None when none is constrained."""
        constrained = [r for r in requests if r.structured_output is not None]
        if not constrained:
            return None
        bitmask = torch.full(
            (len(constrained), bitmask_words(self._vocab_size)), -1, dtype=torch.int32
        )
        rows = {}
        for row, request in enumerate(constrained):
            matcher = request.structured_output.matcher
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_bitmask(bitmask, row)
            rows[request.request_id] = row
        return bitmask, rows

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
        self._executor.shutdown(wait=False, cancel_futures=True)
