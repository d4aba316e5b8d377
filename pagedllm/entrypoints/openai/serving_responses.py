"""`POST /v1/responses` (OpenAI's Responses API) on top of the chat pipeline.

A request becomes a chat completion request (instructions as a system message in front of
the stored conversation and the input, tools and tool_choice in chat's form) that goes
through `OpenAIServingChat`'s checks, template rendering, tool plan, structured output and
generation; only the answer's shape is this module's: a Response object with `message` and
`function_call` output items, or the typed event stream (`response.created` ...
`response.completed`, each with its `sequence_number`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import TypeAdapter

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.responses_protocol import (
    InputItem,
    ResponsesRequest,
    items_to_messages,
)
from pagedllm.entrypoints.openai.responses_store import ResponsesStore, StoredResponse
from pagedllm.entrypoints.openai.serving import Prompt, sse, stream_with_errors
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.tenants import current_tenant_name
from pagedllm.entrypoints.openai.tool_calls import ToolCall, ToolCallStreamer, ToolPlan
from pagedllm.errors import InvalidRequestError
from pagedllm.outputs import CompletionOutput

# Chat's names for fields that the Responses API calls otherwise.
_RESPONSES_PARAM = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}
_OUTPUT_ITEMS = TypeAdapter(list[InputItem])


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponsesStore | None) -> None:
        self.chat = chat
        self.store = store  # None: --responses-store-size 0, nothing is kept

    async def create_response(self, request: ResponsesRequest, raw: Request):
        chat = self.chat
        chat.check_request(request, request.refused_fields())  # type: ignore[arg-type]
        history = self._history(request)
        request.check_call_outputs(
            {call["id"] for message in history for call in message.get("tool_calls", ())}
        )
        conversation = history + request.input_messages()
        try:
            chat_request = self._chat_request(request, conversation)
            prepared = await chat.prepare_chat(chat_request)
        except InvalidRequestError as error:
            raise _renamed(error) from None
        plan, prompt, params = prepared.plan, prepared.prompt, prepared.params
        response_id = f"resp_{uuid.uuid4().hex}"
        request_id = raw.headers.get("x-request-id") or response_id
        chat.log_request(request_id, [prompt], params)
        results = chat.generations(
            request_id, [prompt], [params], chat_request, prepared.lora_request
        )
        answer = _Answer(request, response_id, prepared.model_name, prompt)
        answer.stored = self._will_store(request)
        headers = {"X-Request-Id": request_id}
        if request.stream:
            events = self._stream(answer, results, plan, conversation)
            return StreamingResponse(
                stream_with_errors(events), media_type="text/event-stream", headers=headers
            )
        final = None
        async for _, output in results:
            final = output
        assert final is not None
        completion = final.outputs[0]
        content, calls = plan.parse(completion.text) if plan.active else (completion.text, [])
        status = item_status(completion.finish_reason)
        output = ([message_item(content or "", status)] if content or not calls else []) + [
            call_item(call, call.arguments, status) for call in calls
        ]
        self._keep(answer, conversation, output)
        body = answer.body(completion, output, len(completion.token_ids), final.num_cached_tokens)
        return JSONResponse(body, headers=headers)

    # ---- the chat pipeline ----------------------------------------------------------------
    def _chat_request(
        self, request: ResponsesRequest, conversation: list[dict[str, Any]]
    ) -> ChatCompletionRequest:
        messages = list(conversation)
        if request.instructions is not None:
            messages.insert(0, {"role": "system", "content": request.instructions})
        if not messages:
            raise InvalidRequestError("input: needs at least one item", "input")
        fields: dict[str, Any] = {
            "model": request.model,
            "messages": messages,
            "max_completion_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": request.stream,
            "tools": request.chat_tools(),
            "tool_choice": request.chat_tool_choice(),
            "parallel_tool_calls": request.parallel_tool_calls,
            "user": request.user,
            "response_format": request.chat_response_format(),
        }
        return ChatCompletionRequest.model_validate(fields)

    # ---- the store ------------------------------------------------------------------------
    def _history(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        """The conversation `previous_response_id` continues ([] without one)."""
        if self.store is None:
            for field_name in ("store", "previous_response_id"):
                value = getattr(request, field_name)
                if value is not None and value is not False:
                    raise OpenAIError(
                        400,
                        f"{field_name}: this server keeps no responses (start it with "
                        "--responses-store-size N to keep the last N per API key)",
                        field_name,
                    )
            return []
        if request.previous_response_id is None:
            return []
        stored = self.store.get(current_tenant_name(), request.previous_response_id)
        if stored is None:
            raise OpenAIError(
                404,
                f"Previous response with id '{request.previous_response_id}' not found.",
                "previous_response_id",
            )
        return [dict(message) for message in stored.messages]

    def _will_store(self, request: ResponsesRequest) -> bool:
        return self.store is not None and request.store is not False

    def _keep(self, answer: _Answer, conversation: list[dict], output: list[dict]) -> None:
        if not answer.stored or self.store is None:
            return
        messages = conversation + items_to_messages(_OUTPUT_ITEMS.validate_python(output))
        self.store.put(answer.tenant, StoredResponse(answer.response_id, tuple(messages)))

    # ---- streaming ------------------------------------------------------------------------
    async def _stream(
        self, answer: _Answer, results, plan: ToolPlan, conversation: list[dict]
    ) -> AsyncIterator[str]:
        events = EventWriter()
        yield events.emit("response.created", response=answer.body(None, [], 0, 0))
        yield events.emit("response.in_progress", response=answer.body(None, [], 0, 0))
        items = StreamedItems(events)
        streamer = ToolCallStreamer(plan) if plan.active else None
        num_tokens, num_cached, last = 0, 0, None
        async for _, output in results:
            num_cached = output.num_cached_tokens
            for completion in output.outputs:
                num_tokens += len(completion.token_ids)
                finished = completion.finish_reason is not None
                if streamer is not None:
                    delta = streamer.delta(completion.text, finished)
                else:
                    delta = {"content": completion.text} if completion.text else {}
                for event in items.on_delta(delta):
                    yield event
                if finished:
                    last = completion
        assert last is not None
        for event in items.close(item_status(last.finish_reason)):
            yield event
        self._keep(answer, conversation, items.output)
        body = answer.body(last, items.output, num_tokens, num_cached)
        yield events.emit(_FINAL_EVENT[body["status"]], response=body)


_FINAL_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


def _renamed(error: InvalidRequestError) -> InvalidRequestError:
    """Chat's error, naming the Responses API's fields where chat calls them otherwise."""
    message, param = str(error), error.param
    if param in _RESPONSES_PARAM and message.startswith(f"{param}:"):
        message = _RESPONSES_PARAM[param] + message[len(param) :]
    for chat_name in ("max_tokens", "response_format"):  # names nothing else uses
        message = message.replace(chat_name, _RESPONSES_PARAM[chat_name])
    return InvalidRequestError(message, _RESPONSES_PARAM.get(param or "", param))


# ---- the answer's shape -------------------------------------------------------------------
def item_status(finish_reason: str | None) -> str:
    return "completed" if finish_reason == "stop" else "incomplete"


def message_item(text: str | None, status: str) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [output_text(text)],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: ToolCall, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


class _Answer:
    """What the Response object says besides its output: the request's settings echoed."""

    def __init__(
        self, request: ResponsesRequest, response_id: str, model_name: str, prompt: Prompt
    ) -> None:
        self.request = request
        self.response_id = response_id
        self.model_name = model_name
        self.num_prompt_tokens = len(prompt.token_ids)
        self.created_at = int(time.time())
        self.stored = False
        # Read now: a stream's end runs after the request's own context.
        self.tenant = current_tenant_name()

    def body(
        self,
        completion: CompletionOutput | None,
        output: list[dict],
        num_output_tokens: int,
        num_cached_tokens: int,
    ) -> dict[str, Any]:
        request = self.request
        status, incomplete, error = _outcome(completion)
        text_format = request.text.format if request.text is not None else None
        body = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model_name,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": None,
            "service_tier": request.service_tier or "default",
            "store": self.stored,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {
                "format": {"type": "text"} if text_format is None else text_format.echo(),
                "verbosity": "medium",
            },
            "tool_choice": _tool_choice_echo(request),
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": request.user,
            "metadata": request.metadata or {},
        }
        if completion is not None:
            body["completed_at"] = int(time.time()) if status == "completed" else None
            body["usage"] = {
                "input_tokens": self.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": num_cached_tokens},
                "output_tokens": num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.num_prompt_tokens + num_output_tokens,
            }
        return body


def _outcome(completion: CompletionOutput | None) -> tuple[str, dict | None, dict | None]:
    """(status, incomplete_details, error) of a response whose generation ended so."""
    if completion is None:
        return "in_progress", None, None
    reason = completion.finish_reason
    if reason == "stop":
        return "completed", None, None
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if reason == "error":
        message = completion.error or "the generation failed"
        return "failed", None, {"code": "server_error", "message": message}
    return "incomplete", {"reason": None}, None


def _tool_choice_echo(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)


# ---- the event stream ---------------------------------------------------------------------
class EventWriter:
    """Typed SSE events, numbered in the order sent."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def emit(self, event_type: str, **fields: Any) -> str:
        payload = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {event_type}\n{sse(payload)}"


class StreamedItems:
    """Turns chat-style deltas (content, tool-call starts and argument pieces, as
    `ToolCallStreamer` makes them) into the output items' events, in OpenAI's order:
    item added, (content part added, text deltas, text done, content part done | argument
    deltas, arguments done), item done."""

    def __init__(self, events: EventWriter) -> None:
        self.events = events
        self.output: list[dict[str, Any]] = []  # every item, in output_index order
        self.message: dict[str, Any] | None = None  # the message item taking text
        self.calls: dict[int, dict[str, Any]] = {}  # open calls by the delta's index

    def on_delta(self, delta: dict[str, Any]) -> list[str]:
        sent = []
        if delta.get("content"):
            if self.message is None:
                sent += self._open_message()
            sent.append(self._text_delta(delta["content"]))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                sent += self._close_message("completed")
                tool_call = ToolCall(function.get("name", ""), "", call["id"])
                sent.append(self._add(call_item(tool_call, "", "in_progress")))
                self.calls[call.get("index", 0)] = self.output[-1]
            item = self.calls.get(call.get("index", 0))
            if item is not None and function.get("arguments"):
                item["arguments"] += function["arguments"]
                sent.append(
                    self.events.emit(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self.output.index(item),
                        delta=function["arguments"],
                    )
                )
        return sent

    def close(self, status: str) -> list[str]:
        # An empty answer is still one (empty) message.
        sent = self._open_message() if not self.output else []
        sent += self._close_message(status)
        for item in self.calls.values():
            index = self.output.index(item)
            item["status"] = status
            sent.append(
                self.events.emit(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
            sent.append(
                self.events.emit("response.output_item.done", output_index=index, item=item)
            )
        self.calls = {}
        return sent

    def _add(self, item: dict[str, Any]) -> str:
        self.output.append(item)
        index = len(self.output) - 1
        return self.events.emit("response.output_item.added", output_index=index, item=item)

    def _open_message(self) -> list[str]:
        message = message_item(None, "in_progress")
        sent = [self._add(message)]
        message["content"].append(output_text(""))
        self.message = message
        sent.append(
            self.events.emit(
                "response.content_part.added",
                item_id=message["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                part=output_text(""),
            )
        )
        return sent

    def _text_delta(self, text: str) -> str:
        assert self.message is not None
        self.message["content"][0]["text"] += text
        return self.events.emit(
            "response.output_text.delta",
            item_id=self.message["id"],
            output_index=self.output.index(self.message),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _close_message(self, status: str) -> list[str]:
        message = self.message
        if message is None:
            return []
        self.message = None
        index = self.output.index(message)
        part = message["content"][0]
        message["status"] = status
        where = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [
            self.events.emit("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self.events.emit("response.content_part.done", **where, part=part),
            self.events.emit("response.output_item.done", output_index=index, item=message),
        ]
