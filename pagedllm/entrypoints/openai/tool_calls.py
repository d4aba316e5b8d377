"""Tool calling on /v1/chat/completions: what `tools` + `tool_choice` mean for the prompt,
the constraint and the answer.

- `required` and a named function are enforced by a grammar built from the tools' JSON
  schemas, so the arguments always validate: a named function's output *is* its arguments;
  `required` produces a JSON array of `{"name", "arguments"}` objects.
- `auto` leaves the model free and parses its text with the server's tool-call parser
  (`--tool-call-parser`: hermes, llama3_json, mistral, pythonic, qwen3_coder; see
  `tool_parsers.py`).
- `none` renders no tools and parses nothing.
When the model's chat template has no tool support, the tools are described to the model in
a system message in the hermes format, so `auto` still has a chance to work.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    TOOL_PARSERS,
    ToolParser,
    parse_with,
)
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str

    def as_dict(self, index: int | None = None) -> dict:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call["index"] = index
        return call


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice mean: mode is none, auto, required or named."""

    mode: str
    functions: tuple[dict[str, Any], ...]
    named: str | None = None
    parallel: bool = True
    parser_name: str | None = None  # the auto parser (`--tool-call-parser`)

    @property
    def parser(self) -> ToolParser:
        return TOOL_PARSERS[self.parser_name or "hermes"]

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the auto parser reads special tokens (mistral's `[TOOL_CALLS]`)."""
        return self.mode == "auto" and self.active and self.parser.keeps_special_tokens

    @property
    def active(self) -> bool:
        return self.mode != "none" and bool(self.functions)

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            function = next(f for f in self.functions if f["name"] == self.named)
            return StructuredOutputsParams(json=_parameters(function))
        if self.mode == "required":
            defs: dict[str, Any] = {}
            items = [_call_schema(f, i, defs) for i, f in enumerate(self.functions)]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            if defs:
                schema["$defs"] = defs
            return StructuredOutputsParams(json=schema)
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished answer."""
        if self.mode == "named":
            return None, [ToolCall(self.named or "", text, new_call_id())]
        if self.mode == "required":
            return None, _parse_required(text)
        if self.mode == "auto":
            parser = self.parser
            content, raw = parse_with(parser, text, self.functions)
            calls = [ToolCall(n, a, parser.new_call_id() or new_call_id()) for n, a in raw]
            return content, calls if self.parallel else calls[:1]
        return text, []


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    auto_parser: str | None,
) -> ToolPlan:
    functions = tuple(_function(tool, i) for i, tool in enumerate(tools or []))
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                'tool_choice: expected {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in {f["name"] for f in functions}:
            raise InvalidRequestError(f"tool_choice: no tool named {name!r}", "tool_choice")
        return ToolPlan("named", functions, name, parallel)
    if tool_choice not in ("none", "auto", "required"):
        raise InvalidRequestError(f"tool_choice: unknown value {tool_choice!r}", "tool_choice")
    if tool_choice != "none" and not functions:
        raise InvalidRequestError(f"tool_choice: {tool_choice!r} needs tools", "tool_choice")
    if tool_choice == "auto" and functions and auto_parser is None:
        raise InvalidRequestError(
            'tool_choice: "auto" needs the server started with --enable-auto-tool-choice '
            "--tool-call-parser NAME (" + ", ".join(TOOL_CALL_PARSERS) + ")",
            "tool_choice",
        )
    return ToolPlan(tool_choice, functions, None, parallel, auto_parser)


def _function(tool: Any, index: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(function, dict)
    ):
        raise InvalidRequestError(
            f'tools[{index}]: expected {{"type": "function", "function": {{...}}}}', "tools"
        )
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError(f"tools[{index}].function.name: required", "tools")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"tools[{index}].function.parameters: must be an object", "tools")
    return {**function, "parameters": parameters}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function["parameters"]


def _call_schema(function: dict[str, Any], index: int, defs: dict[str, Any]) -> dict[str, Any]:
    """One call of `function` as an item of the `required` array; its parameters' local
    definitions move to the array schema's `$defs` (under names of their own), since a
    `#/$defs/...` reference resolves from the root of the schema it ends up in."""
    parameters = dict(_parameters(function))
    local = {**parameters.pop("definitions", {}), **parameters.pop("$defs", {})}
    names = {name: f"tool{index}_{name}" for name in local}
    arguments = _rebased(parameters, names)
    for name, definition in local.items():
        defs[names[name]] = _rebased(definition, names)
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": arguments},
        "required": ["name", "arguments"],
    }


def _rebased(value: Any, names: dict[str, str]) -> Any:
    """`value` with each local reference (`#/$defs/X`, `#/definitions/X`) renamed to X's
    place in the combined schema; other references are left as they are."""
    if isinstance(value, list):
        return [_rebased(item, names) for item in value]
    if not isinstance(value, dict):
        return value
    rebased = {key: _rebased(item, names) for key, item in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str):
        for prefix in ("#/$defs/", "#/definitions/"):
            if ref.startswith(prefix) and ref[len(prefix) :] in names:
                rebased["$ref"] = f"#/$defs/{names[ref[len(prefix) :]]}"
    return rebased


def _parse_required(text: str) -> list[ToolCall]:
    """The calls of a `required` answer: every complete item of its JSON array, so an answer
    cut short by max_tokens still returns the calls it finished."""
    return [
        ToolCall(item["name"], json.dumps(item["arguments"]), new_call_id())
        for item in _complete_array_items(text)
        if isinstance(item, dict) and "name" in item and "arguments" in item
    ]


def _complete_array_items(text: str) -> list[Any]:
    """The items of the JSON array `text` starts, up to the first one that is cut short."""
    decoder = json.JSONDecoder()
    position = _skip_space(text, 0)
    if not text.startswith("[", position):
        return []
    items, position = [], position + 1
    while True:
        position = _skip_space(text, position)
        if text.startswith(",", position):
            position = _skip_space(text, position + 1)
        if position >= len(text) or text.startswith("]", position):
            return items
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return items  # the item max_tokens cut
        items.append(item)


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\n\r":
        position += 1
    return position


def hermes_system_prompt(functions: tuple[dict[str, Any], ...]) -> str:
    """Tool descriptions for a chat template that cannot render tools itself."""
    signatures = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    return (
        "You can call functions to answer. Their signatures, one JSON object per line, are "
        f"between <tools> and </tools>:\n<tools>\n{signatures}\n</tools>\n"
        "To call a function, answer with a JSON object holding its name and arguments "
        'between <tool_call> and </tool_call>:\n<tool_call>\n{"name": "function name", '
        '"arguments": {"argument name": "value"}}\n</tool_call>'
    )


def finish_reason(plan: ToolPlan, reason: str | None, made_calls: bool) -> str | None:
    """OpenAI says "tool_calls" when the model chose to call (auto, required); a forced
    named call ends with the plain reason."""
    if made_calls and reason == "stop" and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


class ToolCallStreamer:
    """Turns one choice's streamed text into OpenAI deltas: argument deltas for a named
    function; complete calls at the end for `required`; for `auto`, content until the
    parser says a call may start, then the parsed calls when the answer ends."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.num_sent_chars = 0
        self.made_calls = False
        self._call_id = new_call_id()

    def delta(self, new_text: str, finished: bool) -> dict[str, Any]:
        self.text += new_text
        if self.plan.mode == "named":
            return self._named_delta(new_text)
        if not finished:
            if self.plan.mode == "required":
                return {}
            hold = self.plan.parser.hold_from(self.text)
            return self._content_until(len(self.text) if hold < 0 else hold)
        text = self.text if self.plan.mode == "required" else self.text[self.num_sent_chars :]
        content, calls = self.plan.parse(text)
        self.num_sent_chars = len(self.text)
        self.made_calls = bool(calls)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [call.as_dict(i) for i, call in enumerate(calls)]
        return delta

    def _named_delta(self, new_text: str) -> dict[str, Any]:
        if not self.made_calls:
            self.made_calls = True
            call = ToolCall(self.plan.named or "", new_text, self._call_id).as_dict(0)
            return {"tool_calls": [call]}
        return (
            {"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]} if new_text else {}
        )

    def _content_until(self, end: int) -> dict[str, Any]:
        if end <= self.num_sent_chars:
            return {}
        content = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return {"content": content}
