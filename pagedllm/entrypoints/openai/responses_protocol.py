"""The body of `POST /v1/responses` (OpenAI's Responses API), checked, and its translation
into what the chat pipeline takes: chat messages, chat-format tools and tool_choice, and a
structured-output spec for `text.format`.

Only what this server does is accepted; every other field OpenAI defines (`background`,
`reasoning`, built-in tools, `include` values, ...) is refused naming it; unknown fields, at
any depth, are logged by path and ignored (refused with `--strict-request-fields`). Input
items are checked before pydantic reads them, so a wrong item names its place
(`input[2].content[0].type`) rather than every member of a union.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    StrictBool,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from pagedllm.entrypoints.openai.protocol import Int64, OpenAIModel, RequestBody
from pagedllm.errors import InvalidRequestError

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
ITEM_TYPES = ("message", "function_call", "function_call_output")
PART_TYPES = ("input_text", "output_text")
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# Fields OpenAI defines that this server does not do: refused when given a value other than
# the one that means "off" (the openai client sends none of them unless asked to).
REFUSED_UNLESS = {
    "background": (None, False),
    "reasoning": (None,),
    "prompt": (None,),
    "conversation": (None,),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
    "truncation": (None, "disabled"),
    "include": (None, []),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
}


class ContentPart(OpenAIModel):
    """Text in a message: `input_text`, or `output_text` as earlier output is sent back."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


def _item_type(item: Any) -> str:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


_INPUT_ITEM: TypeAdapter[Any] = TypeAdapter(InputItem)


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class FunctionToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        """As chat's `response_format`, which the structured-output code reads."""
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None or not self.name:
            raise InvalidRequestError(
                "text.format: type json_schema needs name and schema", "text.format"
            )
        json_schema = {"name": self.name, "schema": self.schema_, "strict": self.strict}
        if self.description is not None:
            json_schema["description"] = self.description
        return {"type": "json_schema", "json_schema": json_schema}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesStreamOptions(OpenAIModel):
    include_obfuscation: bool | None = None  # nothing is padded: accepted, means nothing


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Int64 | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    # This server's ids are 37 characters; a longer one cannot be stored, and the 404 that
    # names an unknown id echoes it.
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    store: StrictBool | None = None  # "yes" is not true
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    # OpenAI's fields this server does not do (see REFUSED_UNLESS).
    background: Any = None
    reasoning: Any = None
    prompt: Any = None
    conversation: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    truncation: Any = None
    include: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _check_items(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        return [read_item(item, f"input[{index}]") for index, item in enumerate(value)]

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI's bounds: it is echoed in every response and stream event.
        if value is not None and (
            len(value) > MAX_METADATA_PAIRS
            or any(len(k) > MAX_METADATA_KEY_CHARS for k in value)
            or any(len(v) > MAX_METADATA_VALUE_CHARS for v in value.values())
        ):
            raise InvalidRequestError(
                f"metadata: at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                f"{MAX_METADATA_KEY_CHARS} characters, values of at most "
                f"{MAX_METADATA_VALUE_CHARS}",
                "metadata",
            )
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tools(cls, value: Any) -> Any:
        names: set[str] = set()
        for index, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise InvalidRequestError(
                    f"tools[{index}].type: {kind!r} tools are not supported by this server; "
                    "only function tools",
                    f"tools[{index}].type",
                )
            name = tool.get("name") if isinstance(tool, dict) else None
            if not isinstance(name, str):
                continue  # pydantic names what is wrong with it
            if name in names:  # a call could not say which one it means
                raise InvalidRequestError(
                    f"tools[{index}].name: a tool of this name is already defined",
                    f"tools[{index}].name",
                )
            names.add(name)
        return value

    def check_call_outputs(self, earlier_call_ids: set[str]) -> None:
        """Each function_call_output answers a function_call made before it: in `input`, or
        in the conversation `previous_response_id` continues (`earlier_call_ids`)."""
        if isinstance(self.input, str):
            return
        known = set(earlier_call_ids)
        for index, item in enumerate(self.input):
            if isinstance(item, FunctionCallItem):
                known.add(item.call_id)
            elif isinstance(item, FunctionCallOutputItem) and item.call_id not in known:
                raise InvalidRequestError(
                    f"input[{index}].call_id: no function_call with this call_id comes before "
                    "this output",
                    f"input[{index}].call_id",
                )

    def refused_fields(self) -> list[str]:
        return [
            name
            for name, allowed in REFUSED_UNLESS.items()
            if getattr(self, name) not in allowed or _is_bool_like(getattr(self, name), allowed)
        ]

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options: only allowed with stream=true", "stream_options"
            )

    # ---- the chat pipeline's form ---------------------------------------------------------
    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (instructions not included: they are not carried
        into a follow-up's conversation)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_to_messages(self.input)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else [tool.for_chat() for tool in self.tools]

    def chat_tool_choice(self) -> Any:
        if isinstance(self.tool_choice, FunctionToolChoice):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    def chat_response_format(self) -> dict[str, Any] | None:
        if self.text is None or self.text.format is None:
            return None
        return self.text.format.for_chat()


def _is_bool_like(value: Any, allowed: tuple) -> bool:
    # 0 == False and 1 == True in Python: `background: 0` must not pass as False.
    return type(value) not in (type(a) for a in allowed)


def read_item(item: Any, where: str) -> Any:
    """The input item read, or a 400 naming its place and what is wrong there."""
    check_item(item, where)
    try:
        return _INPUT_ITEM.validate_python(item)
    except ValidationError as error:
        first = error.errors()[0]
        # The union's tag leads the location: the item's type, already known.
        place = "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"][1:]
        )
        raise InvalidRequestError(f"{where}{place}: {first['msg']}", f"{where}{place}") from None


def check_item(item: Any, where: str) -> None:
    """Refuse an input item this server cannot read, naming its place."""
    if not isinstance(item, dict):
        raise InvalidRequestError(f"{where}: must be an object", where)
    kind = item.get("type", "message")
    if kind not in ITEM_TYPES:
        raise InvalidRequestError(
            f"{where}.type: {kind!r} items are not supported by this server; expected one "
            f"of {', '.join(ITEM_TYPES)}",
            f"{where}.type",
        )
    parts = item.get("content") if kind == "message" else item.get("output")
    field_name = "content" if kind == "message" else "output"
    for index, part in enumerate(parts if isinstance(parts, list) else []):
        part_type = part.get("type") if isinstance(part, dict) else None
        if isinstance(part_type, str) and part_type not in PART_TYPES:
            place = f"{where}.{field_name}[{index}].type"
            raise InvalidRequestError(
                f"{place}: {part_type!r} content is not supported by this server; "
                "only text (input_text, output_text)",
                place,
            )


def items_to_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages: a run of function_call items is one assistant message
    with tool_calls (joined to the assistant text just before it), an output a tool message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages
