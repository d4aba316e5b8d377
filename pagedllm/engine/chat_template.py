"""Chat templates rendered with bounds: the model's own and a caller's alike.

A chat template is a Jinja program, and a request's own template is a program written by a
stranger. Every template is compiled in Jinja's `ImmutableSandboxedEnvironment` (configured
as transformers' `apply_chat_template` configures it, so trusted templates render the same
text) and rendered under three bounds:

- time: at the deadline a watchdog thread raises an exception in the rendering thread
  (`PyThreadState_SetAsyncExc`, delivered at the thread's next Python call or loop
  iteration). A thread cannot be killed, but this stops loops that emit nothing as surely as
  loops that emit text, and costs a template that finishes in time nothing;
- output: the text is counted chunk by chunk as the template writes it;
- values: every string or list the template builds (operators, `~`, calls, filters) is held
  to the same budget, and the operations that multiply one value into a huge one in a single
  C call (`*`, `**`, padding and `%`/`format` widths, `replace`, `join`, `expandtabs`,
  `translate`, `indent`, `wordwrap`, `tojson(indent)`) are refused before they run.

Rendering blocks the calling thread until done or refused; the server runs it off the event
loop on small pools of its own (`render_off_loop`), one for the model's template and one for
request templates. A template past a bound is an `InvalidRequestError` naming `param`.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import heapq
import itertools
import json
import numbers
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedllm.errors import InvalidRequestError

# Wall-clock limit on one rendering: the model's template takes milliseconds; a request
# template still running after this is refused.
RENDER_TIMEOUT_S = 2.0
# Threads the server renders the model's chat template on, and as many for request templates.
CHAT_TEMPLATE_THREADS = 2
# Output (and per-value) limit when the caller gives none: more text than any context
# window holds. The server passes the longest prompt its context window can hold.
DEFAULT_MAX_OUTPUT_CHARS = 1 << 24
# Lists, tuples and dicts a template builds hold at most this many items (a sort of a longer
# one is a long uninterruptible C call).
MAX_ITEMS = 1 << 20
# Integers a template computes stay within this many bits (`2 ** 10 ** 9` never starts).
MAX_INT_BITS = 4096
# `tojson(indent=...)` multiplies every nested line; real templates indent by 2 or 4.
MAX_JSON_INDENT = 16

# The marker transformers appends to the message being continued (continue_final_message).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Message fields transformers fills from one another so templates find the reasoning.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Numbers written in a format string: widths, precisions and positions.
_FORMAT_NUMBER = re.compile(r"\d+")

_limits = threading.local()


class _TooLarge(Exception):
    """A value or the output went past the budget (an Exception, so Jinja's constant
    folding at compile time gives up on it and leaves it to the bounded render)."""


class _Deadline(BaseException):
    """Raised in the rendering thread by the watchdog. A BaseException, so no
    `except Exception` between the template and the renderer swallows it."""


def _budget() -> int:
    return getattr(_limits, "max_chars", DEFAULT_MAX_OUTPUT_CHARS)


# ---- size checks ---------------------------------------------------------------------------


def _checked(value: Any) -> Any:
    """`value`, unless it is a string longer than the budget or a container past MAX_ITEMS."""
    if isinstance(value, str | bytes):
        if len(value) > getattr(_limits, "max_chars", DEFAULT_MAX_OUTPUT_CHARS):
            raise _TooLarge(f"a string of {len(value)} characters")
    elif isinstance(value, list | tuple | dict | set | frozenset) and len(value) > MAX_ITEMS:
        raise _TooLarge(f"a collection of {len(value)} items")
    return value


def _approx_len(value: Any) -> int:
    """About how many characters `str(value)` has (only used to bound amplification)."""
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, Mapping):
        return sum([_approx_len(k) + _approx_len(v) + 4 for k, v in value.items()]) + 2
    if isinstance(value, list | tuple | set | frozenset):
        return _items_len(value) + 2 * len(value) + 2
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3 + 2
    return 32


def _items_len(items: Iterable[Any]) -> int:
    return sum([len(i) if isinstance(i, str) else _approx_len(i) for i in items])


def _refuse_if_over(estimate: int) -> None:
    if estimate > _budget():
        raise _TooLarge(f"a result of about {estimate} characters")


def _check_format(template: str, values: Sequence[Any]) -> None:
    """`template % values` or `template.format(...)`: widths plus every field at its
    longest argument."""
    numbers_in = _FORMAT_NUMBER.findall(template)
    if max(map(len, numbers_in), default=0) >= 12:
        raise _TooLarge("a format width beyond any budget")
    fields = template.count("%") + template.count("{")
    longest = max([_approx_len(v) for v in values], default=0)
    _refuse_if_over(len(template) + sum(map(int, numbers_in)) + fields * longest)


def _format_values(args: Any) -> list[Any]:
    if isinstance(args, Mapping):
        return list(args.values())
    if isinstance(args, tuple):
        return list(args)
    return [args]


def _check_ints(args: Iterable[Any]) -> None:
    """No width, count or size argument beyond the budget (`ljust`, `center`, `zfill`, ...)."""
    for value in args:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _budget():
            raise _TooLarge(f"an argument of {value}")


def _check_str_method(name: str, text: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a string method call whose result would pass the budget; returns the
    arguments to call it with (an iterable given to `join` is read into a list first)."""
    if name in ("format", "format_map"):
        values = _format_values(args[0]) if name == "format_map" and args else list(args)
        _check_format(text, [*values, *kwargs.values()])
    elif name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        matches = len(text) + 1 if not old else len(text) // len(old)
        _refuse_if_over(len(text) + matches * len(new))
    elif name == "join" and args:
        items = list(args[0])
        _refuse_if_over(len(text) * len(items) + _items_len(items))
        args = (items, *args[1:])
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _refuse_if_over(len(text) + text.count("\t") * size)
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max([_approx_len(v) for v in args[0].values()], default=0)
        _refuse_if_over(len(text) * max(longest, 1))
    return args


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, str | bytes | list | tuple) and isinstance(count, int):
                _refuse_if_over(len(seq) * max(count, 0))
                if not isinstance(seq, str | bytes) and len(seq) * max(count, 0) > MAX_ITEMS:
                    raise _TooLarge("a list of too many items")
        ints = isinstance(left, int) and isinstance(right, int)
        if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise _TooLarge("an integer of too many digits")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int):
        if abs(left) > 1 and right > 0 and left.bit_length() * right > MAX_INT_BITS:
            raise _TooLarge("an integer of too many digits")
    elif operator == "%" and isinstance(left, str):
        _check_format(left, _format_values(right))


# Filters that can multiply their input, with the check to run on their arguments.
def _check_filter(name: str, args: tuple, kwargs: dict) -> tuple:
    value = args[0] if args else None
    if name == "join" and value is not None:
        # An iterable is read into a list first, so its length is known before joining.
        items = value if isinstance(value, str) else list(value)
        sep = args[1] if len(args) > 1 else kwargs.get("d", "")
        _refuse_if_over(_approx_len(sep) * len(items))
        _refuse_if_over(_approx_len(sep) * len(items) + _items_len(items))
        return (items, *args[1:])
    text = value if isinstance(value, str) else None
    if text is None:
        return args
    if name == "replace" and len(args) >= 3:
        return (text, *_check_str_method("replace", text, args[1:], kwargs))
    if name == "format":
        _check_format(text, [*args[1:], *kwargs.values()])
    elif name == "indent":
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _refuse_if_over(len(text) + (text.count("\n") + 1) * pad)
    elif name == "wordwrap":
        width = args[1] if len(args) > 1 else kwargs.get("width", 79)
        wrap = args[3] if len(args) > 3 else kwargs.get("wrapstring") or "\n"
        if isinstance(width, int) and width > 0:
            _refuse_if_over(len(text) + (len(text) // width + 1) * _approx_len(wrap))
    return args


def _guard_filter(name: str, func: Callable) -> Callable:
    # Filters that get the environment or a context first keep it; the checks see the rest.
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        head, rest = args[:skip], args[skip:]
        _check_ints(rest[1:])
        _check_ints(kwargs.values())
        rest = _check_filter(name, rest, kwargs)
        return _checked(func(*head, *rest, **kwargs))

    return guarded


# ---- the environment -------------------------------------------------------------------------


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with every `~` concatenation held to the budget."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.checked(")
        super().visit_Concat(node, frame)
        self.write(")")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders
    its body unchanged; the mask itself is never asked for here."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` for templates, without the class's attributes (as transformers does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` refusing underscore names, which lead to CPython's internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every operator, call and filter held to the budget."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _TemplateNamespace

    def checked(self, value: Any) -> Any:
        return _checked(value)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        # `+` is the common case in templates (joining message parts): no check before it,
        # since a sum is at most twice the larger of two values already within the budget.
        if operator != "+":
            _check_binop(operator, left, right)
        return _checked(self.binop_table[operator](left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _check_ints(args)
        _check_ints(kwargs.values())
        # str.format reaches here wrapped by the sandbox; the bound method is underneath.
        method = getattr(obj, "__wrapped__", obj)
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            args = _check_str_method(getattr(method, "__name__", ""), owner, args, kwargs)
        return _checked(super().call(context, obj, *args, **kwargs))


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter (Jinja's own escapes HTML), with the indent bounded.
    if isinstance(indent, int | str) and not isinstance(indent, bool):
        size = indent if isinstance(indent, int) else len(indent)
        if size > MAX_JSON_INDENT:
            raise _TooLarge(f"tojson indent of {size}")
    if separators is not None and _approx_len(separators) > MAX_JSON_INDENT:
        raise _TooLarge("tojson separators")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=1)
def _environment() -> _BoundedSandbox:
    return _BoundedSandbox()


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


# ---- the bounds ------------------------------------------------------------------------------


def _raise_in_thread(thread_id: int, exception: type[BaseException] | None) -> None:
    """Have `exception` raised in the thread at its next function call or backward jump
    (the check CPython makes for KeyboardInterrupt); None withdraws one not raised yet."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), None if exception is None else ctypes.py_object(exception)
    )


class _Render:
    """One rendering's deadline. `interrupt` (the watchdog's) and `finish` (the renderer's)
    take the same lock, so `_Deadline` is raised only while the rendering is running and a
    raise still pending when it finishes is withdrawn: it can never land after it."""

    __slots__ = ("deadline", "done", "fired", "lock", "thread_id")

    def __init__(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.thread_id = threading.get_ident()
        self.lock = threading.Lock()
        self.done = False
        self.fired = False

    def interrupt(self) -> None:
        with self.lock:
            if not self.done:
                self.fired = True
                _raise_in_thread(self.thread_id, _Deadline)

    def finish(self) -> None:
        with self.lock:
            self.done = True
            if self.fired:
                _raise_in_thread(self.thread_id, None)


class _Watchdog:
    """One daemon thread for the process, interrupting each rendering at its deadline. It
    costs a rendering nothing while it runs (no tracing), and needs the GIL only at a
    deadline, which CPython hands over within its switch interval (5 ms)."""

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._heap: list[tuple[float, int, _Render]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, render: _Render) -> None:
        with self._wake:
            heapq.heappush(self._heap, (render.deadline, next(self._order), render))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="chat-template-watchdog", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        with self._wake:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._wake.wait()
                    continue
                wait_s = self._heap[0][0] - time.monotonic()
                if wait_s > 0:
                    self._wake.wait(wait_s)
                    continue
                heapq.heappop(self._heap)[2].interrupt()


_WATCHDOG = _Watchdog()
# The server renders on these threads, not asyncio's default pool: templates running to
# their deadline hold at most these threads' share of the GIL (the event loop keeps the rest)
# and never the threads that tokenize other requests. Rendering needs the GIL, so more
# threads would not render faster.
_MODEL_TEMPLATE_POOL = ThreadPoolExecutor(CHAT_TEMPLATE_THREADS, "chat-template")
_REQUEST_TEMPLATE_POOL = ThreadPoolExecutor(CHAT_TEMPLATE_THREADS, "request-chat-template")


def _render_chunks(source: str, variables: Mapping[str, Any], max_output_chars: int) -> list[str]:
    chunks: list[str] = []
    written = 0
    for chunk in _compile(source).generate(**variables):
        written += len(chunk)
        if written > max_output_chars:
            raise _TooLarge(f"more than {max_output_chars} characters of output")
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
    render = _Render(timeout_s)
    previous_budget = getattr(_limits, "max_chars", None)
    try:
        try:
            _limits.max_chars = max_output_chars
            _WATCHDOG.watch(render)
            chunks = _render_chunks(source, variables, max_output_chars)
        finally:
            render.finish()
            if previous_budget is None:
                del _limits.max_chars
            else:
                _limits.max_chars = previous_budget
        return "".join(chunks)
    except _Deadline:
        raise InvalidRequestError(
            f"{param}: the chat template did not finish rendering within {timeout_s:g} s "
            f"(stopped after {time.monotonic() - started:.1f} s)",
            param,
        ) from None
    except _TooLarge as error:
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
