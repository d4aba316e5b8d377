"""Structured output's scheduler side as a participant of the scheduling loop: a request
waits while its grammar compiles (and ends if it fails), each step's bitmask covers the
requests that sample, each sampled token advances its request's matcher, and drafts are
cut to the prefix the grammar allows. A grammar that raises fails its own request alone.
Requests without a spec (and engines without structured output) pass through untouched."""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING

from pagedllm.core.request import Request
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.errors import describe_error
from pagedllm.fault_isolation import isolate_row_faults

if TYPE_CHECKING:
    from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("pagedllm")


class GrammarStatus(enum.Enum):
    READY = enum.auto()  # no grammar, or a compiled one
    COMPILING = enum.auto()
    FAILED = enum.auto()


def failure_message(error: str) -> str:
    return f"structured_outputs: the grammar failed: {error}"


class GrammarScheduling:
    def __init__(self, manager: StructuredOutputManager | None) -> None:
        self.manager = manager

    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is None:
            return
        if self.manager is None:
            raise ValueError("structured_outputs: this engine has no structured output")
        self.manager.add_request(request)

    def status(self, request: Request) -> GrammarStatus:
        """Whether a waiting request's grammar is ready; one whose matcher could not be
        built is FAILED (`error` says why)."""
        if self.manager is None or request.structured_output is None:
            return GrammarStatus.READY
        try:
            ready = self.manager.is_ready(request)
        except Exception as error:  # building its matcher raised: this request's alone
            logger.exception("Request %s: its grammar failed", request.request_id)
            request.structured_output.error = describe_error(error)
            ready = True
        if not ready:
            return GrammarStatus.COMPILING
        if request.structured_output.error is not None:
            return GrammarStatus.FAILED
        return GrammarStatus.READY

    def error(self, request: Request) -> str:
        assert request.structured_output is not None
        return failure_message(str(request.structured_output.error))

    def compiling(self, request: Request) -> bool:
        """Whether the grammar still compiles (no side effect: admission handles errors)."""
        if self.manager is None or request.structured_output is None:
            return False
        try:
            return not self.manager.is_ready(request)
        except Exception:
            return False

    def add_bitmask(
        self, output: SchedulerOutput, requests: dict[str, Request], failed: dict[str, str]
    ) -> None:
        """The step's bitmask, for the scheduled requests that sample (drafts run past
        num_tokens until the step's outcome rolls them back). When filling it raises, each
        request is tried alone and those whose matcher raises fail (with the samples they
        forked this step, which sample from their row) and are left out; an error no single
        request reproduces raises."""
        if self.manager is None:
            return
        sampling = [
            request
            for request_id in output.num_scheduled_tokens
            if (request := requests[request_id]).num_computed_tokens >= request.num_tokens
        ]
        manager, drafts = self.manager, output.scheduled_spec_decode_tokens

        def fail(request: Request, error: Exception) -> None:
            logger.exception("Request %s: its grammar bitmask failed", request.request_id)
            forked = output.forked_samples.get(request.request_id, ())
            for request_id in (request.request_id, *forked):
                failed[request_id] = failure_message(describe_error(error))

        result, _ = isolate_row_faults(lambda rows: manager.bitmask(rows, drafts), sampling, fail)
        if result is not None:
            output.grammar_bitmask, output.grammar_rows = result

    def fork(self, parent: Request, child: Request) -> str | None:
        """A forked sample continues its parent's matcher; the error if that raises."""
        if self.manager is None or parent.structured_output is None:
            return None
        try:
            self.manager.fork(parent, child)
        except Exception as error:  # its matcher: this sample fails alone
            logger.exception("Request %s: its grammar failed", child.request_id)
            return failure_message(describe_error(error))
        return None

    def accept(self, request: Request, token_id: int) -> tuple[bool, str | None]:
        """(whether the grammar is complete, the error if its matcher raised)."""
        if self.manager is None or request.structured_output is None:
            return False, None
        try:
            return self.manager.accept(request, token_id), None
        except Exception as error:  # its grammar alone: it ends, the batch goes on
            logger.exception("Request %s: its grammar failed", request.request_id)
            return True, failure_message(describe_error(error))

    def valid_prefix(self, request: Request, drafts: list[int]) -> list[int]:
        if self.manager is None or request.structured_output is None:
            return drafts
        try:
            return self.manager.valid_prefix(request, drafts)
        except Exception:  # speculation is optional: the grammar's own step reports
            logger.exception("Request %s: checking drafts failed", request.request_id)
            return []
