"""Tool-call parsers for `tool_choice: "auto"`: the text formats model families write calls in,
parsed as vLLM's parser of the same name reads them (`--tool-call-parser`).

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- `llama3_json` (Llama 3.1-3.3): `{"name": ..., "parameters": {...}}` at the start of the answer
  or after `<|python_tag|>`, several separated by `;`
- `mistral` (Mistral, Mixtral): `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or the newer
  tokenizers' `[TOOL_CALLS]name{...}` / `[TOOL_CALLS]name[ARGS]{...}`
- `pythonic` (Llama 3.2/4, ToolACE): `[get_weather(city="Paris"), get_time()]`, read with `ast`
  as literals only (nothing is evaluated)
- `qwen3_coder` (Qwen3-Coder): `<tool_call><function=name><parameter=p>value</parameter>
  </function></tool_call>`, each value converted to its JSON-schema type

Each parser says where a call may start (`call_start`), so a stream sends the content before
it at once and parses the rest when the answer ends; `parse` reads the same text the same
way, so streamed and whole answers agree. Text that does not parse stays content: a malformed
call is never an error.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
from collections.abc import Callable
from typing import Any, Protocol

# The functions offered to the model (`ToolPlan.functions`): name, description, parameters.
Functions = tuple[dict[str, Any], ...]
# One parsed call: (name, arguments as JSON text).
RawCall = tuple[str, str]


class ToolParser(Protocol):
    """One format. `call_start` is where a complete call opener is (-1: none); `hold_from` is
    where a stream must stop sending content (a call, or the start of a partial opener);
    `parse_calls` reads the text from `call_start` on: the calls and leftover content, or
    None when that text is not well-formed calls."""

    name: str
    # Special tokens the format's calls start with: the decoder must keep them.
    keeps_special_tokens: bool

    def call_start(self, text: str) -> int: ...

    def hold_from(self, text: str) -> int: ...

    def parse_calls(self, text: str, functions: Functions) -> tuple[list[RawCall], str] | None: ...

    def new_call_id(self) -> str | None: ...


def parse_with(
    parser: ToolParser, text: str, functions: Functions
) -> tuple[str | None, list[RawCall]]:
    """(content, calls) of a finished answer: content before the first call and whatever
    the calls leave; calls naming a tool that was not offered are dropped (as hermes did)."""
    start = parser.call_start(text)
    if start < 0:
        return text, []
    parsed = parser.parse_calls(text[start:], functions)
    names = {function["name"] for function in functions}
    calls = [call for call in parsed[0] if call[0] in names] if parsed else []
    if not parsed or not calls:
        return text, []
    content = (text[:start] + parsed[1]).strip()
    return content or None, calls


def _partial_opener(text: str, openers: tuple[str, ...]) -> int:
    """Where a cut-short opener ends `text` (`<tool_` of `<tool_call>`), or -1."""
    starts = [
        len(text) - size
        for opener in openers
        for size in range(len(opener) - 1, 0, -1)
        if text.endswith(opener[:size])
    ]
    return min(starts, default=-1)


def _earliest(*positions: int) -> int:
    found = [position for position in positions if position >= 0]
    return min(found, default=-1)


def _leading(text: str, prefixes: tuple[str, ...]) -> int:
    """Where the answer's first non-blank text starts when it is one of `prefixes`, else -1;
    a blank answer so far (or one that is a prefix of one) holds from its start."""
    stripped = text.lstrip()
    start = len(text) - len(stripped)
    if any(stripped.startswith(prefix) for prefix in prefixes):
        return start
    return -1


def _leading_hold(text: str, prefixes: tuple[str, ...]) -> int:
    stripped = text.lstrip()
    if not stripped or any(prefix.startswith(stripped) for prefix in prefixes):
        return len(text) - len(stripped)
    return _leading(text, prefixes)


def _arguments_json(arguments: Any) -> str | None:
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def _json_call(item: Any, arguments_keys: tuple[str, ...]) -> RawCall | None:
    """`{"name": ..., "arguments": {...}}` (or one of `arguments_keys`) as a call."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    key = next((key for key in arguments_keys if key in item), None)
    arguments = _arguments_json(item[key] if key else {})
    return None if arguments is None else (item["name"], arguments)


class HermesParser:
    name = "hermes"
    keeps_special_tokens = False
    OPEN = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def call_start(self, text: str) -> int:
        return text.find(self.OPEN)

    def hold_from(self, text: str) -> int:
        return _earliest(self.call_start(text), _partial_opener(text, (self.OPEN,)))

    def parse_calls(self, text: str, functions: Functions) -> tuple[list[RawCall], str] | None:
        calls = []
        for block in self._BLOCK.findall(text):
            try:
                call = _json_call(json.loads(block), ("arguments", "parameters"))
            except json.JSONDecodeError:
                continue
            if call is not None:
                calls.append(call)
        return (calls, self._BLOCK.sub("", text)) if calls else None

    def new_call_id(self) -> str | None:
        return None


class Llama3JsonParser:
    """Llama 3's JSON calls: the model answers with them (its template asks for JSON only),
    so a call starts the answer or follows `<|python_tag|>` (which skip_special_tokens drops,
    as in vLLM)."""

    name = "llama3_json"
    keeps_special_tokens = False
    TAG = "<|python_tag|>"

    def call_start(self, text: str) -> int:
        return _earliest(_leading(text, ("{",)), text.find(self.TAG))

    def hold_from(self, text: str) -> int:
        return _earliest(
            _leading_hold(text, ("{", self.TAG)),
            text.find(self.TAG),
            _partial_opener(text, (self.TAG,)),
        )

    def parse_calls(self, text: str, functions: Functions) -> tuple[list[RawCall], str] | None:
        decoder, calls = json.JSONDecoder(), []
        text = text.replace(self.TAG, "", 1)
        position = _skip(text, 0)
        while True:
            try:
                item, position = decoder.raw_decode(text, position)
            except json.JSONDecodeError:
                return None
            call = _json_call(item, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            position = _skip(text, position)
            if not text.startswith(";", position):
                return calls, text[position:]
            position = _skip(text, position + 1)

    def new_call_id(self) -> str | None:
        return None


def _skip(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


class MistralParser:
    """Mistral's calls follow the `[TOOL_CALLS]` special token, so the decoder keeps special
    tokens for these requests (vLLM does the same with a Hugging Face tokenizer)."""

    name = "mistral"
    keeps_special_tokens = True
    OPEN = "[TOOL_CALLS]"
    _NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)(?:\[ARGS\])?")

    def call_start(self, text: str) -> int:
        return text.find(self.OPEN)

    def hold_from(self, text: str) -> int:
        return _earliest(self.call_start(text), _partial_opener(text, (self.OPEN,)))

    def parse_calls(self, text: str, functions: Functions) -> tuple[list[RawCall], str] | None:
        calls: list[RawCall] = []
        for segment in text.split(self.OPEN)[1:]:
            parsed = self._segment(segment)
            if parsed is None:
                return None
            calls += parsed
        return (calls, "") if calls else None

    def _segment(self, segment: str) -> list[RawCall] | None:
        """One `[TOOL_CALLS]`'s calls: a JSON array of objects, or `name{...}` pairs."""
        decoder = json.JSONDecoder()
        position = _skip(segment, 0)
        if segment.startswith("[", position):
            try:
                items, end = decoder.raw_decode(segment, position)
            except json.JSONDecodeError:
                return None
            if not isinstance(items, list) or segment[end:].strip():
                return None
            calls = [_json_call(item, ("arguments",)) for item in items]
            return None if None in calls else calls  # type: ignore[return-value]
        calls = []
        while position < len(segment):
            name = self._NAME.match(segment, position)
            if name is None:
                return None
            try:
                arguments, position = decoder.raw_decode(segment, name.end())
            except json.JSONDecodeError:
                return None
            if _arguments_json(arguments) is None:
                return None
            calls.append((name.group(1), _arguments_json(arguments) or "{}"))
            position = _skip(segment, position)
            if segment.startswith(",", position):
                position = _skip(segment, position + 1)
        return calls or None

    def new_call_id(self) -> str | None:
        # Mistral's templates refuse ids that are not 9 letters and digits (mistral-common).
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class PythonicParser:
    """A Python list of calls with keyword arguments, the whole answer (Llama 4 may wrap it
    in `<|python_start|>`/`<|python_end|>`). Read with `ast` and `literal_eval`: only
    literals are accepted, nothing is run."""

    name = "pythonic"
    keeps_special_tokens = False
    START, END = "<|python_start|>", "<|python_end|>"

    def call_start(self, text: str) -> int:
        return _leading(text, ("[", self.START))

    def hold_from(self, text: str) -> int:
        return _leading_hold(text, ("[", self.START))

    def parse_calls(self, text: str, functions: Functions) -> tuple[list[RawCall], str] | None:
        source = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        try:
            tree = ast.parse(source, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = [_pythonic_call(node) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None
        return None if None in calls else (calls, "")  # type: ignore[return-value]

    def new_call_id(self) -> str | None:
        return None


def _pythonic_call(node: ast.expr) -> RawCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(keyword.arg is None for keyword in node.keywords):  # **kwargs
        return None
    arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
    return node.func.id, json.dumps(arguments, ensure_ascii=False)  # TypeError: not JSON


class Qwen3CoderParser:
    """Qwen3-Coder's XML-like calls; parameter values are text, converted by the type the
    tool's schema gives them (a string stays as written)."""

    name = "qwen3_coder"
    keeps_special_tokens = False
    OPEN = "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
    _FUNCTION = re.compile(r"<function=([^>]+)>(.*?)(?:</function>|$)", re.DOTALL)
    _PARAMETER = re.compile(
        r"<parameter=([^>]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL
    )

    def call_start(self, text: str) -> int:
        return text.find(self.OPEN)

    def hold_from(self, text: str) -> int:
        return _earliest(self.call_start(text), _partial_opener(text, (self.OPEN,)))

    def parse_calls(self, text: str, functions: Functions) -> tuple[list[RawCall], str] | None:
        schemas = {f["name"]: f.get("parameters", {}).get("properties", {}) for f in functions}
        calls = []
        for block in self._CALL.findall(text):
            function = self._FUNCTION.search(block)
            if function is None:
                return None
            name = function.group(1).strip()
            properties = schemas.get(name, {})
            arguments = {
                key.strip(): _typed(_trim(value), properties.get(key.strip(), {}))
                for key, value in self._PARAMETER.findall(function.group(2))
            }
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        return (calls, self._CALL.sub("", text)) if calls else None

    def new_call_id(self) -> str | None:
        return None


def _trim(value: str) -> str:
    """The template writes each value between newlines; they are not part of it."""
    return value.removeprefix("\n").removesuffix("\n")


def _typed(value: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    kind = next((k for k in kind if k != "null"), None) if isinstance(kind, list) else kind
    if value.strip().lower() == "null" and kind != "string":
        return None
    converters: dict[str | None, Callable[[str], Any]] = {
        "string": str,
        "integer": int,
        "number": _number,
        "boolean": _boolean,
    }
    try:
        return converters.get(kind, _json_or_literal)(value.strip() if kind != "string" else value)
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return value  # as written: the model's text, not an error


def _number(value: str) -> int | float:
    number = float(value)
    return int(number) if number.is_integer() and "." not in value and "e" not in value else number


def _boolean(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise ValueError(value)
    return value.lower() == "true"


def _json_or_literal(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    literal = ast.literal_eval(value)
    json.dumps(literal)  # TypeError when it has no JSON form: keep the text
    return literal


TOOL_PARSERS: dict[str, ToolParser] = {
    parser.name: parser
    for parser in (
        HermesParser(),
        Llama3JsonParser(),
        MistralParser(),
        PythonicParser(),
        Qwen3CoderParser(),
    )
}
TOOL_CALL_PARSERS = tuple(TOOL_PARSERS)
