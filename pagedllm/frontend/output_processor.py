"""`OutputProcessor`: turns the core's per-step token outputs into user-facing `RequestOutput`s.

Owns, per request: detokenization and stop strings (a stop string ends the request here,
and the engine aborts it in the core), logprobs with decoded tokens, first-token and
finish times, and the shape of each output (cumulative, delta or final only).

Fault isolation: a request the core failed (finish_reason "error") ends with its error on
its `CompletionOutput`; one whose own detokenization raises here ends the same way, and the
engine aborts it in the core. Other requests never see either.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprob
from pagedllm.core.request import child_request_id
from pagedllm.errors import describe_error
from pagedllm.frontend.detokenizer import IncrementalDetokenizer
from pagedllm.frontend.token_decoder import token_text_decoder
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedllm")


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer | None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    # Prompt index -> logprobs; keyed so a recompute after preemption overwrites, not repeats.
    prompt_logprobs: dict[int, PositionLogprobs] = field(default_factory=dict)
    text: str = ""  # text released so far (stop-string hold-back excluded)
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # finish_reason "error": what failed
    index: int = 0  # which of the request's n completions this is
    group: SampleGroup | None = None  # the request's n completions when n > 1
    pooling: bool = False  # an embedding request: it ends with one vector, no tokens
    pooled: list[float] | None = None


@dataclass
class SampleGroup:
    """The n completions of one request with n > 1 (index 0 is the parent itself)."""

    parent: RequestState
    member_ids: list[str]
    latest: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0
    num_outputs: int = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.member_ids)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode_token = None if tokenizer is None else token_text_decoder(tokenizer)
        self.states: dict[str, RequestState] = {}
        self.groups: dict[str, SampleGroup] = {}  # by parent id, until all n finish

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        """Track a request the core was sent (with n > 1, its n samples under one id)."""
        request_id, params = request.request_id, request.sampling_params
        prompt_token_ids, arrival_time = request.prompt_token_ids, request.arrival_time
        metrics = RequestMetrics(arrival_time)
        member_ids = [child_request_id(request_id, i) for i in range(params.n)]
        states = [
            RequestState(
                member_id,
                prompt,
                prompt_token_ids,
                params,
                metrics,
                self._detokenizer(prompt_token_ids, params),
                index=index,
            )
            for index, member_id in enumerate(member_ids)
        ]
        states[0].pooling = request.pooling_params is not None
        if params.n > 1:
            group = SampleGroup(states[0], member_ids)
            self.groups[request_id] = group
            for state in states:
                state.group = group
        for state in states:
            self.states[state.request_id] = state

    def _detokenizer(self, prompt_token_ids, params: SamplingParams):
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    def family(self, request_id: str) -> list[str]:
        """The ids the core knows the request by: itself and, when n > 1, its children."""
        group = self.groups.get(request_id)
        return [request_id] if group is None else list(group.member_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget the request; its final output (finish_reason "abort") if it was known."""
        result = None
        for member_id in self.family(request_id):
            state = self.states.pop(member_id, None)
            if state is None:
                continue
            state.finish_reason = "abort"
            state.metrics.finished_time = time.monotonic()
            result = self._make_output(state, finished=True, force=True) or result
        return result

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(outputs to hand to users, ids finished here that the core must abort: by a stop
        string, or by a failure of their own detokenization)."""
        results, stopped = [], []
        now = time.monotonic()
        for output in outputs:
            state = self.states.get(output.request_id)
            if state is None:
                continue
            try:
                finished = self._absorb(state, output, now)
            except Exception as error:  # this request's text alone: it ends, the rest go on
                logger.exception("Request %s: detokenization failed", output.request_id)
                finished = True
                state.finish_reason, state.stop_reason = "error", None
                state.error = f"detokenization failed: {describe_error(error)}"
            if finished and not output.finished:  # the core still runs it
                stopped.append(output.request_id)
            if finished:
                state.metrics.finished_time = now
                del self.states[output.request_id]
            result = self._make_output(state, finished)
            if result is not None:
                results.append(result)
        return results, stopped

    def _absorb(self, state: RequestState, output: EngineCoreOutput, now: float) -> bool:
        """Take one step's tokens into the state; True if the request is now finished."""
        if output.new_token_ids and not state.output_token_ids:
            state.metrics.first_token_time = now
            state.metrics.first_scheduled_time = output.first_scheduled_time
        for token_id, entry in zip(output.new_token_ids, output.new_logprobs or (), strict=False):
            state.logprobs.append(self._position_logprobs(token_id, entry))
        for index, entry in (output.new_prompt_logprobs or {}).items():
            token_id = state.prompt_token_ids[index]
            state.prompt_logprobs[index] = self._position_logprobs(token_id, entry)
        state.output_token_ids.extend(output.new_token_ids)
        if output.new_token_ids:
            state.cumulative_logprob = output.cumulative_logprob
            state.num_cached_tokens = output.num_cached_tokens
        detokenizer = state.detokenizer
        num_kept, stop_string = self._detokenize(detokenizer, output.new_token_ids)
        if num_kept < len(output.new_token_ids):
            self._drop_after_stop(state, output, num_kept)
        finished = output.finished
        state.finish_reason, state.stop_reason = output.finish_reason, output.stop_reason
        state.error = output.error
        state.pooled = output.pooling_output
        if stop_string is not None:
            finished = True
            state.finish_reason, state.stop_reason = "stop", stop_string
        if finished and detokenizer is not None:
            detokenizer.finish()
        if detokenizer is not None:
            state.text += detokenizer.get_next_delta()
        return finished

    @staticmethod
    def _drop_after_stop(state: RequestState, output: EngineCoreOutput, num_kept: int) -> None:
        """The tokens of a step after the one that completed a stop string (speculative
        decoding's runs) are not the request's, nor are their logprobs."""
        num_dropped = len(output.new_token_ids) - num_kept
        del state.output_token_ids[-num_dropped:]
        dropped_logprobs = (output.new_logprobs or [])[num_kept:]
        if dropped_logprobs:
            del state.logprobs[-len(dropped_logprobs) :]
            if state.cumulative_logprob is not None:
                state.cumulative_logprob -= sum(entry[0] for entry in dropped_logprobs)

    @staticmethod
    def _detokenize(detokenizer, token_ids: list[int]) -> tuple[int, str | None]:
        """(how many of a step's tokens the request keeps, the stop string they completed).
        Several tokens in one step (speculative decoding) are checked one at a time, so a
        stop string completed inside the run drops the tokens after it, as it would have
        without speculation."""
        if detokenizer is None or not token_ids or detokenizer.finished:
            return len(token_ids), None
        if len(token_ids) == 1 or not detokenizer.has_stop_strings:
            return len(token_ids), detokenizer.update(token_ids)
        for index, token_id in enumerate(token_ids):
            stop_string = detokenizer.update([token_id])
            if stop_string is not None:
                return index + 1, stop_string
        return len(token_ids), None

    def _make_output(
        self, state: RequestState, finished: bool, force: bool = False
    ) -> RequestOutput | PoolingRequestOutput | None:
        if state.pooling:
            return self._pooling_output(state) if finished else None
        kind = state.params.output_kind
        has_news = len(state.output_token_ids) > state.num_sent_tokens
        if not force and (
            (kind == RequestOutputKind.FINAL_ONLY and not finished and state.group is None)
            or (not has_news and not finished)
        ):
            return None
        start = state.num_sent_tokens if kind == RequestOutputKind.DELTA else 0
        text = state.text[state.num_sent_chars :] if kind == RequestOutputKind.DELTA else state.text
        state.num_sent_chars = len(state.text)
        completion = CompletionOutput(
            index=state.index,
            text=text,
            token_ids=state.output_token_ids[start:],
            cumulative_logprob=state.cumulative_logprob,
            finish_reason=state.finish_reason if finished else None,
            stop_reason=state.stop_reason if finished else None,
            logprobs=state.logprobs[start:] if state.params.logprobs is not None else None,
            error=state.error if finished else None,
        )
        first_output = state.num_sent_tokens == 0
        state.num_sent_tokens = len(state.output_token_ids)
        if state.group is not None:
            return self._group_output(state, completion, finished)
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            [completion],
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            prompt_logprobs=self._prompt_logprobs(state, first_output),
        )

    @staticmethod
    def _pooling_output(state: RequestState) -> PoolingRequestOutput:
        return PoolingRequestOutput(
            state.request_id,
            state.prompt_token_ids,
            PoolingOutput(state.pooled),
            metrics=state.metrics,
            error=state.error,
        )

    def _group_output(
        self, state: RequestState, completion: CompletionOutput, finished: bool
    ) -> RequestOutput | None:
        """n > 1: streamed kinds get the completion that moved; final-only gets all n at once,
        and also early when one fails (so the server can fail the request without waiting)."""
        group = state.group
        assert group is not None
        group.latest[state.index] = completion
        group.num_finished += int(finished)
        if group.finished:
            self.groups.pop(group.parent.request_id, None)
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not group.finished and completion.error is None:
            return None
        parent = group.parent
        first_output = group.num_outputs == 0
        group.num_outputs += 1
        completions = (
            [group.latest[i] for i in sorted(group.latest)]
            if kind == RequestOutputKind.FINAL_ONLY
            else [completion]
        )
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            completions,
            finished=group.finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics,
            prompt_logprobs=self._prompt_logprobs(parent, first_output),
        )

    def _prompt_logprobs(self, state: RequestState, first_output: bool):
        if state.params.prompt_logprobs is None:
            return None
        if state.params.output_kind == RequestOutputKind.DELTA and not first_output:
            return None
        num_prompt = len(state.prompt_token_ids)
        return [None] + [state.prompt_logprobs.get(i) for i in range(1, num_prompt)]

    def _position_logprobs(self, token_id: int, entry: TokenLogprob) -> PositionLogprobs:
        """The chosen token (always present) and the top alternatives, with their text."""
        logprob, rank, top_ids, top_logprobs = entry
        result = {token_id: Logprob(logprob, rank, self._token_text(token_id))}
        for top_rank, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs, strict=True)):
            if top_id != token_id:
                result[top_id] = Logprob(top_logprob, top_rank + 1, self._token_text(top_id))
        return result

    def _token_text(self, token_id: int) -> str | None:
        return None if self._decode_token is None else self._decode_token(token_id)
