"""`POST /v1/chat/completions`: messages rendered by the model's chat template, n choices,
logprobs with top alternatives, streaming deltas with an optional usage chunk; a thinking
model's reasoning split off (`reasoning.py`), then tool calls parsed (`tool_calls.py`)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeRequest
from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningStreamer
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
from pagedllm.entrypoints.openai.tool_calls import (
    ToolCallStreamer,
    ToolPlan,
    finish_reason,
    hermes_system_prompt,
    plan_tools,
)
from pagedllm.errors import InvalidRequestError
from pagedllm.frontend.chat_template import render_off_loop
from pagedllm.frontend.processor import render_chat
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class PreparedChat:
    """A chat request checked and converted (`prepare_chat`): what the engine runs and what
    its response needs. `pagedllm run-batch` runs these through the offline LLM."""

    lora_request: LoRARequest | None
    model_name: str
    plan: ToolPlan
    prompt: Prompt
    params: SamplingParams
    # Whether the answer starts inside the thinking; None: no reasoning split.
    inside_thinking: bool | None = None


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw: Request):
        prepared = await self.prepare_chat(request)
        lora_request, model_name = prepared.lora_request, prepared.model_name
        plan, prompt, params = prepared.plan, prepared.prompt, prepared.params
        request_id = self.request_id(raw, request, "chatcmpl")
        self.log_request(request_id, [prompt], params)
        results = self.generations(request_id, [prompt], [params], request, lora_request)
        headers = {"X-Request-Id": request_id}
        inside = prepared.inside_thinking
        if request.stream:
            chunks = self._stream(request_id, request, prompt, results, plan, model_name, inside)
            return StreamingResponse(
                stream_with_errors(chunks), media_type="text/event-stream", headers=headers
            )
        final = None
        async for _, output in results:
            final = output
        assert final is not None
        body = self._response(request_id, request, prompt, final, plan, model_name, inside)
        return JSONResponse(body, headers=headers)

    async def prepare_chat(self, request: ChatCompletionRequest) -> PreparedChat:
        """Every check and conversion before the engine: an error here is the client's 4xx."""
        lora_request = self.check_request(request, request.refused_fields())
        model_name = self.response_model(lora_request)
        auto_parser = self.config.tool_call_parser if self.config.enable_auto_tool_choice else None
        plan = plan_tools(
            request.tools, request.tool_choice, request.parallel_tool_calls, auto_parser
        )
        prompt = await self.render(request, plan)
        max_tokens = self.max_tokens(
            request.max_completion_tokens or request.max_tokens, len(prompt.token_ids), None
        )
        params = request.sampling_params(
            max_tokens, request.num_logprobs(), request.prompt_logprobs
        )
        tool_constraint = plan.constraint()
        extra = [("tool_choice", tool_constraint)] if tool_constraint is not None else []
        params = self.with_structured_output(params, request, extra)
        if plan.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        inside = self._inside_thinking(prompt, params, request)
        return PreparedChat(lora_request, model_name, plan, prompt, params, inside)

    def _inside_thinking(
        self, prompt: Prompt, params: SamplingParams, request: ChatCompletionRequest
    ) -> bool | None:
        """Whether the answer starts inside the thinking, or None when it is not split: no
        reasoning parser, or an answer a JSON grammar holds from its first token (tool_choice
        required or named, response_format, guided_json) has no thinking to split off."""
        name = self.config.reasoning_parser
        constraint = params.structured_outputs
        if name is None or (constraint is not None and (constraint.json or constraint.json_object)):
            return None
        parser = REASONING_PARSERS[name]
        thinking = (request.chat_template_kwargs or {}).get("enable_thinking")
        if thinking is False and not parser.always_inside:
            return False  # Qwen3's switch: the model is not to think, all is content
        return parser.starts_inside(prompt.text or "")

    async def render(
        self, request: ChatCompletionRequest | TokenizeRequest, plan: ToolPlan | None = None
    ) -> Prompt:
        """The chat template's text for the messages, tokenized and checked for length."""
        messages = request.messages or []
        continue_final = request.continue_final_message
        add_generation_prompt = request.add_generation_prompt
        if continue_final and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message: cannot be combined with add_generation_prompt=true",
                "continue_final_message",
            )
        if continue_final and (not messages or messages[-1].role != "assistant"):
            raise InvalidRequestError(
                "continue_final_message: the last message must be the assistant's",
                "continue_final_message",
            )
        template_kwargs = dict(request.chat_template_kwargs or {})
        own_template = self._request_template(request.chat_template, template_kwargs)
        conversation = [message.for_template() for message in messages]
        if plan is not None and plan.active:
            self._add_tools(conversation, template_kwargs, plan, own_template)
        try:
            # Off the event loop, and bounded in time and size (`frontend/chat_template.py`):
            # a template past a bound is refused while the server goes on answering others.
            text = await render_off_loop(
                render_chat,
                self.tokenizer,
                conversation,
                add_generation_prompt,
                continue_final,
                own_template,
                template_kwargs,
                self.max_prompt_chars,
                request_template=own_template is not None,
            )
        except InvalidRequestError:
            raise
        except Exception as error:  # jinja raises many kinds of errors on odd input
            param = "chat_template" if own_template is not None else "messages"
            raise InvalidRequestError(
                f"{param}: the chat template failed: {error}", param
            ) from None
        return Prompt(text, await self.tokenize(text, request.add_special_tokens))

    def _request_template(self, chat_template: str | None, template_kwargs: dict) -> str | None:
        """The request's own template (a field, or vLLM's `chat_template_kwargs.chat_template`),
        refused unless the operator trusts request templates (vLLM's switch and meaning)."""
        own = template_kwargs.pop("chat_template", None)
        own = chat_template if chat_template is not None else own
        if own is not None and not self.config.trust_request_chat_template:
            raise InvalidRequestError(
                "chat_template: this server renders only the model's chat template; a "
                "request's own template needs --trust-request-chat-template",
                "chat_template",
            )
        return own

    def _add_tools(self, conversation, template_kwargs, plan: ToolPlan, chat_template) -> None:
        """Tools go to the template when it can render them; else into a system message."""
        template = chat_template or getattr(self.tokenizer, "chat_template", None) or ""
        if "tools" in template:
            template_kwargs["tools"] = [{"type": "function", "function": f} for f in plan.functions]
            return
        description = hermes_system_prompt(plan.functions)
        if conversation and conversation[0]["role"] == "system":
            conversation[0]["content"] = f"{conversation[0]['content']}\n\n{description}"
        else:
            conversation.insert(0, {"role": "system", "content": description})

    def _logprobs(self, completion: CompletionOutput, top_logprobs: int) -> dict:
        content = []
        for token_id, entry in zip(completion.token_ids, completion.logprobs or (), strict=False):
            chosen = entry[token_id]
            top = sorted(
                (lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_logprobs),
                key=lambda lp: lp.rank or 0,
            )
            content.append({**_token_entry(chosen), "top_logprobs": [_token_entry(t) for t in top]})
        return {"content": content}

    def _choice(self, request, completion: CompletionOutput, body: dict, reason) -> dict:
        logprobs = None
        if request.logprobs:
            logprobs = self._logprobs(completion, request.top_logprobs or 0)
        return {
            "index": completion.index,
            "logprobs": logprobs,
            **body,
            "finish_reason": reason,
            "stop_reason": completion.stop_reason,
        }

    def _message_choice(
        self, request, completion: CompletionOutput, plan: ToolPlan, inside: bool | None
    ) -> dict:
        reasoning, text = None, completion.text
        if inside is not None:
            reasoning, text = REASONING_PARSERS[self.config.reasoning_parser or ""].split(
                completion.text, inside
            )
        content, calls = (text, []) if not plan.active or text is None else plan.parse(text)
        message = {
            "role": "assistant",
            **({} if inside is None else {"reasoning_content": reasoning}),
            "content": content,
            "tool_calls": [call.as_dict() for call in calls],
        }
        reason = finish_reason(plan, completion.finish_reason, bool(calls))
        return self._choice(request, completion, {"message": message}, reason)

    def _response(
        self,
        request_id,
        request,
        prompt: Prompt,
        final: RequestOutput,
        plan,
        model_name: str,
        inside: bool | None = None,
    ) -> dict:
        num_completion = sum(len(c.token_ids) for c in final.outputs)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": now_s(),
            "model": model_name,
            "choices": [self._message_choice(request, c, plan, inside) for c in final.outputs],
            "usage": usage(len(prompt.token_ids), num_completion),
            **(
                {}
                if final.prompt_logprobs is None
                else {"prompt_logprobs": prompt_logprobs_json(final.prompt_logprobs)}
            ),
        }

    def _delta_choice(
        self,
        request,
        completion,
        streamer: ToolCallStreamer | None,
        reasoner: ReasoningStreamer | None,
    ) -> dict:
        finished = completion.finish_reason is not None
        reasoning, text = "", completion.text
        if reasoner is not None:
            reasoning, text = reasoner.delta(completion.text, finished)
        if streamer is None:
            delta = {"content": text} if text else {}
            reason = completion.finish_reason
        else:
            delta = streamer.delta(text, finished)
            reason = finish_reason(streamer.plan, completion.finish_reason, streamer.made_calls)
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        return self._choice(request, completion, {"delta": delta}, reason)

    async def _stream(
        self,
        request_id,
        request,
        prompt: Prompt,
        results,
        plan: ToolPlan,
        model_name: str,
        inside: bool | None,
    ) -> AsyncIterator[str]:
        created = now_s()
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created}
        base["model"] = model_name
        options = request.stream_options
        num_completion = 0
        streamers = {i: ToolCallStreamer(plan) for i in range(request.n)} if plan.active else {}
        reasoners = (
            {} if inside is None else {i: ReasoningStreamer(inside) for i in range(request.n)}
        )
        sent_roles = False
        async for _, output in results:
            if not sent_roles:
                # Only once the first token exists, as OpenAI's server: clients and load
                # generators time the first chunk as the time to first token.
                sent_roles = True
                for index in range(request.n):
                    role = {"index": index, "delta": {"role": "assistant", "content": ""}}
                    choice = {**role, "logprobs": None, "finish_reason": None}
                    choice["stop_reason"] = None  # every chunk's choice has vLLM's fields
                    yield sse({**base, "choices": [choice]})
            for completion in output.outputs:
                num_completion += len(completion.token_ids)
                index = completion.index
                choice = self._delta_choice(
                    request, completion, streamers.get(index), reasoners.get(index)
                )
                if not (choice["delta"] or choice["finish_reason"] or request.logprobs):
                    continue  # tokens held back (a possible stop string or tool call)
                chunk = {**base, "choices": [choice]}
                if options is not None and options.continuous_usage_stats:
                    chunk["usage"] = usage(len(prompt.token_ids), num_completion)
                yield sse(chunk)
        if options is not None and options.include_usage:
            final_usage = usage(len(prompt.token_ids), num_completion)
            yield sse({**base, "choices": [], "usage": final_usage})


def _token_entry(logprob: Logprob) -> dict:
    token = logprob.decoded_token or ""
    return {
        "token": token,
        "logprob": clamp_logprob(logprob.logprob),
        "bytes": list(token.encode("utf-8")),
    }
