"""`POST /v1/completions`: prompts as text, token ids or lists of either; echo, logprobs, n,
streaming with an optional usage chunk."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving import (
    OpenAIServing,
    Prompt,
    clamp_logprob,
    now_s,
    prompt_logprobs_json,
    sse,
    stream_with_errors,
    usage,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams

# OpenAI's default for /v1/completions when max_tokens is not given.
DEFAULT_MAX_TOKENS = 16


@dataclass
class PreparedCompletion:
    """A completion request checked and converted (`prepare_completion`): one prompt and its
    params per engine request. `pagedllm run-batch` runs these through the offline LLM."""

    lora_request: LoRARequest | None
    model_name: str
    prompts: list[Prompt]
    params: list[SamplingParams]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw: Request):
        prepared = await self.prepare_completion(request)
        lora_request, model_name = prepared.lora_request, prepared.model_name
        prompts, params = prepared.prompts, prepared.params
        request_id = self.request_id(raw, request, "cmpl")
        self.log_request(request_id, prompts, params[0])
        results = self.generations(request_id, prompts, params, request, lora_request)
        headers = {"X-Request-Id": request_id}
        if request.stream:
            chunks = self._stream(request_id, request, prompts, results, model_name)
            return StreamingResponse(
                stream_with_errors(chunks), media_type="text/event-stream", headers=headers
            )
        finals: dict[int, RequestOutput] = {}
        async for index, output in results:
            finals[index] = output
        body = self._response(request_id, request, prompts, finals, model_name)
        return JSONResponse(body, headers=headers)

    async def prepare_completion(self, request: CompletionRequest) -> PreparedCompletion:
        """Every check and conversion before the engine: an error here is the client's 4xx."""
        lora_request = self.check_request(request, request.refused_fields())
        model_name = self.response_model(lora_request)
        prompts = await self.read_prompts(request.prompt, request.add_special_tokens, "prompt")
        params = [self._params(request, len(prompt.token_ids)) for prompt in prompts]
        return PreparedCompletion(lora_request, model_name, prompts, params)

    def _params(self, request: CompletionRequest, num_prompt_tokens: int) -> SamplingParams:
        max_tokens = self.max_tokens(request.max_tokens, num_prompt_tokens, DEFAULT_MAX_TOKENS)
        if scores_prompt_only(request):  # one token is generated and dropped, as vLLM does
            max_tokens = self.max_tokens(1, num_prompt_tokens, None)
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
        params = request.sampling_params(max_tokens, request.logprobs, prompt_logprobs)
        return self.with_structured_output(params, request, [])

    def _prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids)
        return prompt.text

    def _choice(
        self,
        request: CompletionRequest,
        prompt_index: int,
        prompt: Prompt,
        output: RequestOutput,
        completion: CompletionOutput,
        echo_prompt: bool,
    ) -> dict:
        text, logprobs = completion.text, None
        token_ids = list(completion.token_ids)
        positions: list[PositionLogprobs | None] = list(completion.logprobs or [])
        if scores_prompt_only(request):
            text, token_ids, positions = "", [], []
        if echo_prompt:
            text = self._prompt_text(prompt) + text
            token_ids = prompt.token_ids + token_ids
            positions = list(output.prompt_logprobs or [None] * len(prompt.token_ids)) + positions
        if request.logprobs is not None:
            logprobs = self._logprobs(token_ids, positions)
        choice = {
            "index": prompt_index * request.n + completion.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if output.prompt_logprobs is not None:  # asked for (or for echo's logprobs), as vLLM
            choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
        return choice

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None]) -> dict:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = 0
        for token_id, entry in zip(token_ids, positions, strict=False):
            if entry is None:  # the first prompt token has no logprob
                token = self.tokenizer.decode([token_id])
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                token = entry[token_id].decoded_token or ""
                token_logprobs.append(clamp_logprob(entry[token_id].logprob))
                top_logprobs.append(
                    {lp.decoded_token or "": clamp_logprob(lp.logprob) for lp in entry.values()}
                )
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _response(
        self, request_id, request, prompts, finals: dict[int, RequestOutput], model_name: str
    ) -> dict:
        choices = [
            self._choice(request, index, prompts[index], output, completion, request.echo)
            for index, output in sorted(finals.items())
            for completion in output.outputs
        ]
        num_completion = sum(
            num_completion_tokens(request, c) for o in finals.values() for c in o.outputs
        )
        return {
            "id": request_id,
            "object": "text_completion",
            "created": now_s(),
            "model": model_name,
            "choices": sorted(choices, key=lambda c: c["index"]),
            "usage": usage(sum(len(p.token_ids) for p in prompts), num_completion),
        }

    async def _stream(
        self, request_id, request, prompts, results, model_name: str
    ) -> AsyncIterator[str]:
        created = now_s()
        num_prompt = sum(len(p.token_ids) for p in prompts)
        num_completion = 0
        options = request.stream_options
        echoed: set[int] = set()
        async for prompt_index, output in results:
            for completion in output.outputs:
                num_completion += num_completion_tokens(request, completion)
                index = prompt_index * request.n + completion.index
                echo = request.echo and index not in echoed
                echoed.add(index)
                choice = self._choice(
                    request, prompt_index, prompts[prompt_index], output, completion, echo
                )
                chunk = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [choice],
                }
                if options is not None and options.continuous_usage_stats:
                    chunk["usage"] = usage(num_prompt, num_completion)
                yield sse(chunk)
        if options is not None and options.include_usage:
            yield sse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [],
                    "usage": usage(num_prompt, num_completion),
                }
            )


def scores_prompt_only(request: CompletionRequest) -> bool:
    """`echo` with `max_tokens: 0`: the prompt comes back (with its logprobs if asked for)
    and nothing is generated, as vLLM answers it (lm-eval scores prompts this way)."""
    return request.echo and request.max_tokens == 0


def num_completion_tokens(request: CompletionRequest, completion: CompletionOutput) -> int:
    return 0 if scores_prompt_only(request) else len(completion.token_ids)
