"""`LLMEngine`: the synchronous engine behind `LLM` — prompts in, `RequestOutput`s out."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pagedllm.config import EngineArgs
from pagedllm.core.scheduler import EngineCoreOutput
from pagedllm.core.scheduler_output import TokenLogprob
from pagedllm.engine.core import EngineCore
from pagedllm.engine.engine_config import build_engine_config
from pagedllm.engine.processor import (
    PromptType,
    check_prompt_length,
    prompt_cache_salt,
    prompt_to_token_ids,
)
from pagedllm.engine.request import Request
from pagedllm.model.loader import load_hf_config, load_tokenizer, resolve_model
from pagedllm.model.registry import resolve_model_class
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


@dataclass
class _RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    # Prompt index -> logprobs; keyed so a recompute after preemption overwrites, not repeats.
    prompt_logprobs: dict[int, PositionLogprobs] = field(default_factory=dict)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        started = time.monotonic()
        source = resolve_model(args.model)
        hf_config = load_hf_config(source)
        resolve_model_class(getattr(hf_config, "architectures", None))
        self.tokenizer = (
            None if args.skip_tokenizer_init else load_tokenizer(source, args.tokenizer)
        )
        self.config = build_engine_config(args, source.path, hf_config, self.tokenizer)
        self.model_config = self.config.model_config
        self.engine_core = EngineCore(self.config, source)
        self._states: dict[str, _RequestState] = {}
        logger.info(
            "Loaded %s (%s) in %.1f s",
            source.path,
            self.model_config.architecture,
            time.monotonic() - started,
        )

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text, token_ids = prompt_to_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)
        check_prompt_length(token_ids, self.model_config.max_model_len)
        return text, token_ids

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> None:
        text, token_ids = self.process_prompt(prompt)
        self.check_priority(priority)
        self.check_sampling_params(params)
        self.add_tokenized_request(
            request_id, text, token_ids, params, priority, prompt_cache_salt(prompt)
        )

    def check_sampling_params(self, params: SamplingParams) -> None:
        """Checks that need the engine's limits (SamplingParams checks the rest itself)."""
        limit = self.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(
                    f"{name}={value} is above max_logprobs={limit} (an engine argument)"
                )

    def check_priority(self, priority: int) -> None:
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError(
                f"priority: {priority} given, but scheduling_policy is "
                f"{self.config.scheduler_config.policy!r}; use scheduling_policy='priority'"
            )

    def add_tokenized_request(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        request = Request(
            request_id,
            token_ids,
            params,
            self.model_config.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt,
        )
        self.engine_core.add_request(request)
        metrics = RequestMetrics(arrival_time=request.arrival_time)
        self._states[request_id] = _RequestState(text, token_ids, params, metrics)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests that finished in it."""
        finished = []
        outputs = self.engine_core.step()
        now = time.monotonic()
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:
                continue
            if output.new_token_ids and not state.output_token_ids:
                state.metrics.first_token_time = now
            self._record_logprobs(state, output)
            state.output_token_ids.extend(output.new_token_ids)
            if output.finished:
                state.metrics.finished_time = now
                del self._states[output.request_id]
                finished.append(self._request_output(output.request_id, state, output))
        return finished

    def _record_logprobs(self, state: _RequestState, output: EngineCoreOutput) -> None:
        for token_id, entry in zip(output.new_token_ids, output.new_logprobs or (), strict=False):
            state.logprobs.append(self._position_logprobs(token_id, entry))
        for index, entry in (output.new_prompt_logprobs or {}).items():
            token_id = state.prompt_token_ids[index]
            state.prompt_logprobs[index] = self._position_logprobs(token_id, entry)

    def _position_logprobs(self, token_id: int, entry: TokenLogprob) -> PositionLogprobs:
        """The chosen token (always present) and the top alternatives, with their text."""
        logprob, rank, top_ids, top_logprobs = entry
        result = {token_id: Logprob(logprob, rank, self._token_text(token_id))}
        for top_rank, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs, strict=True)):
            if top_id != token_id:
                result[top_id] = Logprob(top_logprob, top_rank + 1, self._token_text(top_id))
        return result

    def _token_text(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _request_output(
        self, request_id: str, state: _RequestState, output: EngineCoreOutput
    ) -> RequestOutput:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(
                state.output_token_ids, skip_special_tokens=state.params.skip_special_tokens
            )
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(state.output_token_ids),
            cumulative_logprob=output.cumulative_logprob,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            logprobs=state.logprobs if state.params.logprobs is not None else None,
        )
        prompt_logprobs = None
        if state.params.prompt_logprobs is not None:
            num_prompt = len(state.prompt_token_ids)
            prompt_logprobs = [None] + [state.prompt_logprobs[i] for i in range(1, num_prompt)]
        return RequestOutput(
            request_id,
            state.prompt,
            state.prompt_token_ids,
            [completion],
            finished=True,
            num_cached_tokens=output.num_cached_tokens,
            metrics=state.metrics,
            prompt_logprobs=prompt_logprobs,
        )
