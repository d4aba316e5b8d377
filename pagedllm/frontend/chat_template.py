"""Chat templates rendered with bounds: the model's own and a caller's alike.

A chat template is a Jinja program, and a request's own template is a program written by a
stranger. Every template is compiled in a bounded Jinja sandbox (`template_sandbox.py`,
configured as transformers' `apply_chat_template` configures Jinja, so trusted templates
render the same text) and rendered under three bounds:

- time: at the deadline the rendering thread is interrupted (`thread_deadline.py`);
- output: the text is counted chunk by chunk as the template writes it;
- values: every string or list the template builds is held to the same budget, and the
  operations that would multiply one value into a huge one are refused before they run.

Rendering blocks the calling thread until done or refused; the server runs it off the event
loop on small pools of its own (`render_off_loop`), one for the model's template and one for
request templates. A template past a bound is an `InvalidRequestError` naming `param`.
"""

from __future__ import annotations

import asyncio
import functools
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pagedllm.errors import InvalidRequestError
from pagedllm.frontend.template_sandbox import (
    DEFAULT_MAX_OUTPUT_CHARS,
    TemplateTooLarge,
    compile_template,
    value_budget,
)
from pagedllm.frontend.thread_deadline import DeadlineExceeded, start_deadline

# Wall-clock limit on one rendering: the model's template takes milliseconds; a request
# template still running after this is refused.
RENDER_TIMEOUT_S = 2.0
# Threads the server renders the model's chat template on, and as many for request templates.
CHAT_TEMPLATE_THREADS = 2
# The marker transformers appends to the message being continued (continue_final_message).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Message fields transformers fills from one another so templates find the reasoning.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# The server renders on these threads, not asyncio's default pool: templates running to
# their deadline hold at most these threads' share of the GIL (the event loop keeps the rest)
# and never the threads that tokenize other requests. Rendering needs the GIL, so more
# threads would not render faster.
_MODEL_TEMPLATE_POOL = ThreadPoolExecutor(CHAT_TEMPLATE_THREADS, "chat-template")
_REQUEST_TEMPLATE_POOL = ThreadPoolExecutor(CHAT_TEMPLATE_THREADS, "request-chat-template")


def _render_chunks(source: str, variables: Mapping[str, Any], max_output_chars: int) -> list[str]:
    chunks: list[str] = []
    written = 0
    for chunk in compile_template(source).generate(**variables):
        written += len(chunk)
        if written > max_output_chars:
            raise TemplateTooLarge(f"more than {max_output_chars} characters of output")
        chunks.append(chunk)
    return chunks


def render_template(
    source: str,
    variables: Mapping[str, Any],
    param: str,
    timeout_s: float = RENDER_TIMEOUT_S,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> str:
    """`source` rendered with `variables` in the bounded sandbox (compiling it counts too).

    InvalidRequestError naming `param` past a bound; Jinja's own errors (syntax, undefined,
    `raise_exception`, sandbox violations) pass through unchanged."""
    started = time.monotonic()
    try:
        with value_budget(max_output_chars):
            deadline = start_deadline(timeout_s)
            try:
                chunks = _render_chunks(source, variables, max_output_chars)
            finally:
                deadline.finish()
        return "".join(chunks)
    except DeadlineExceeded:
        raise InvalidRequestError(
            f"{param}: the chat template did not finish rendering within {timeout_s:g} s "
            f"(stopped after {time.monotonic() - started:.1f} s)",
            param,
        ) from None
    except TemplateTooLarge as error:
        raise InvalidRequestError(
            f"{param}: the chat template's output is too large ({error}; the limit is "
            f"{max_output_chars} characters)",
            param,
        ) from None


async def render_off_loop(func: Callable[..., str], *args: Any, request_template: bool) -> str:
    """`func(*args)` (a rendering) on the chat-template threads, awaited: a request's own
    template on threads of its own, so templates that run to their deadline delay only other
    request templates, never a rendering of the model's template."""
    pool = _REQUEST_TEMPLATE_POOL if request_template else _MODEL_TEMPLATE_POOL
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(func, *args))


# ---- apply_chat_template, bounded ------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Only JSON-like data reaches a template (as in transformers): other objects may carry
    methods the sandbox does not know are dangerous, so they become a placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    aliased = []
    for message in conversation:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _tool_schemas(tools: Sequence[Any] | None) -> list[dict] | None:
    if tools is None:
        return None
    schemas = []
    for tool in tools:
        if isinstance(tool, Mapping):
            schemas.append(tool)
        elif callable(tool):
            from transformers.utils import get_json_schema

            schemas.append(get_json_schema(tool))
        else:
            raise ValueError("tools: each tool is a JSON schema or a function with type hints")
    return schemas


def load_chat_template(value: str) -> str:
    """`--chat-template`'s value, as vLLM reads it: a file holding a Jinja template, or the
    template itself. Compiled once here, so a broken template fails at start-up."""
    path = Path(value).expanduser()
    if path.is_file():
        source = path.read_text(encoding="utf-8")
    elif any(mark in value for mark in "{}\n"):
        source = value
    else:
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template")
    try:
        compile_template(source)
    except Exception as error:  # jinja's syntax errors, and the sandbox's refusals
        raise ValueError(f"--chat-template: the template does not compile: {error}") from None
    return source


def template_source(tokenizer: Any, chat_template: str | None, tools: Any = None) -> str:
    """The template to render: the caller's, or the tokenizer's (a name picks one of several,
    as transformers' `get_chat_template` does)."""
    if hasattr(tokenizer, "get_chat_template"):
        return tokenizer.get_chat_template(chat_template, tools)
    source = chat_template or getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str):
        raise InvalidRequestError("chat: the model has no chat template", "chat_template")
    return source


def apply_chat_template(
    tokenizer: Any,
    conversation: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = RENDER_TIMEOUT_S,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> str:
    """`tokenizer.apply_chat_template(conversation, tokenize=False, ...)`'s text, rendered
    within the bounds. A bound names `chat_template` when the caller gave one, else
    `messages` (the model's own template only runs long on what the messages hold)."""
    kwargs = dict(template_kwargs or {})
    tools = _tool_schemas(kwargs.pop("tools", None))
    documents = kwargs.pop("documents", None)
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise ValueError("documents: each document is a dict (with 'title' and 'text' keys)")
    source = template_source(tokenizer, chat_template, tools)
    param = "chat_template" if chat_template is not None else "messages"
    special_tokens = dict(getattr(tokenizer, "special_tokens_map", None) or {})
    variables = _plain({**special_tokens, **kwargs})
    chat = [{k: v for k, v in dict(m).items() if v is not None} for m in conversation]
    chat = _alias_reasoning(_plain(chat))
    final_text = None
    if continue_final_message:
        final_text = _tag_final_message(chat, source)
    text = render_template(
        source,
        {
            **variables,
            "messages": chat,
            "tools": _plain(tools),
            "documents": _plain(documents),
            "add_generation_prompt": add_generation_prompt,
        },
        param,
        timeout_s,
        max_output_chars,
    )
    if final_text is None:
        return text
    return _cut_at_tag(text, final_text)


def _tag_final_message(chat: list[dict[str, Any]], source: str) -> str:
    """Mark the end of the last message so the text after it can be cut (transformers' way
    of leaving the final message open); returns the message's text."""
    if not chat:
        raise ValueError("continue_final_message: the conversation is empty")
    last = chat[-1]
    final = last.get("content")
    if final is None:
        raise ValueError("continue_final_message: the final message has no content")
    if "content" not in source:
        raise ValueError("continue_final_message: the chat template does not render content")
    if isinstance(final, list | tuple):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message: the final message has no text to continue")
    last["content"] = final + _CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError(
            "continue_final_message: the chat template drops part of the final message"
        )
    at = text.rindex(_CONTINUE_TAG.strip())
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()
