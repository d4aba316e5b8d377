"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Every model keeps unknown fields (`extra="allow"`) so the server can name them, at any depth,
by path (`response_format.schema`): by default it logs and ignores them, as vLLM does (a client
sending a newer or another vendor's field still works); with `--strict-request-fields` they
are a 400 naming the path. Nothing a client sends is dropped without a word.

Every body is checked whole before its fields are read (`RequestBody`): nesting at most
`MAX_REQUEST_DEPTH` levels, strings valid Unicode (no lone surrogates), integers within 64
bits and no NaN or Infinity anywhere (Python's json accepts them); then each integer field
is bounded to int64 (seeds to their own range) and each float field is finite. What needs
the model (token ids against the vocabulary, lengths against the context) is checked by the
engine's input processor, shared with the offline `LLM`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from pagedllm.entrypoints.openai.lora_registry import check_lora_name, check_lora_path
from pagedllm.entrypoints.openai.request_ids import check_request_id
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from pagedllm.value_checks import INT64_MAX, INT64_MIN, UINT64_MAX, check_json_value

# OpenAI fields that only describe the caller: accepted, never used for generation.
CALLER_FIELDS = ("user", "metadata", "store", "service_tier")

# Deepest nesting of objects and arrays a body may have. A JSON schema may be 64 levels deep
# (structured_output.validation.MAX_SCHEMA_DEPTH) and sits at most 4 levels into a body
# (tools[i].function.parameters); the rest is margin. Python's json reads ~900 levels, more
# than the recursive steps after it (jsonschema, json.dumps, templates) can take.
MAX_REQUEST_DEPTH = 96

# Integers as the engine holds them (int64); seeds as torch takes them (any 64-bit value).
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=UINT64_MAX)]
# The vocabulary is checked later. Strict: JSON's true and false are not token ids 1 and 0.
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
RequestId = Annotated[str, AfterValidator(lambda value: check_request_id(value, "request_id"))]


# What an unknown field a client is known to send means, said with the warning (or 400).
# instructor's JSON_SCHEMA mode sends {"type": "json_object", "schema": ...}: vLLM, like
# OpenAI, reads json_object as "any JSON object" and ignores the schema, and so does this
# server, but not silently.
UNKNOWN_FIELD_NOTES = {
    "response_format.schema": 'response_format {"type": "json_object"} asks for any JSON '
    "object and its schema is not enforced (as in vLLM); to enforce a schema send "
    '{"type": "json_schema", "json_schema": {"name": ..., "schema": ...}}',
}


class OpenAIModel(BaseModel):
    # No NaN or Infinity in any float field (JSON has neither; Python's json reads both).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def unknown_fields(self) -> list[str]:
        """Unknown fields at any depth, by path (`messages[0].foo`, `response_format.schema`)."""
        return unknown_field_paths(self)

    def unknown_fields_here(self) -> list[str]:
        """This model's own unknown fields (not those of the models it holds)."""
        return sorted(self.model_extra or {})


def unknown_field_paths(model: OpenAIModel, prefix: str = "") -> list[str]:
    """The unknown fields of `model` and of the models it holds, by path."""
    found = [f"{prefix}{name}" for name in model.unknown_fields_here()]
    for name in type(model).model_fields:
        found += _unknown_in(getattr(model, name), f"{prefix}{name}")
    return found


def _unknown_in(value: Any, path: str) -> list[str]:
    if isinstance(value, OpenAIModel):
        return unknown_field_paths(value, f"{path}.")
    if isinstance(value, list):
        return [
            found for i, item in enumerate(value) for found in _unknown_in(item, f"{path}[{i}]")
        ]
    return []


def unknown_field_notes(paths: list[str]) -> list[str]:
    """What the known-to-be-sent ones among `paths` mean (UNKNOWN_FIELD_NOTES)."""
    return [UNKNOWN_FIELD_NOTES[path] for path in paths if path in UNKNOWN_FIELD_NOTES]


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class RequestBody(OpenAIModel):
    """A whole request body, checked before any field is read: see the module docstring."""

    @model_validator(mode="before")
    @classmethod
    def _check_values(cls, data: Any) -> Any:
        # InvalidRequestError names the path to the value; errors.py answers with it.
        check_json_value(data, MAX_REQUEST_DEPTH)
        return data


class SamplingRequest(RequestBody):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    max_tokens: Int64 | None = None
    n: Int64 = 1
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's extra sampling fields
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: Int64 | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Int64 | None = None
    priority: Int64 = 0
    cache_salt: str | None = None
    request_id: RequestId | None = None
    # Structured output: vLLM's field, and its older guided_* names for the same thing.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _merge_extra_body(cls, data: Any) -> Any:
        """Raw-HTTP clients sometimes nest vendor fields in `extra_body`, as the OpenAI SDK's
        argument of that name suggests; treat them as top-level fields."""
        if isinstance(data, dict) and isinstance(data.get("extra_body"), dict):
            data = {**{k: v for k, v in data.items() if k != "extra_body"}, **data["extra_body"]}
        return data

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options: only allowed with stream=true", "stream_options"
            )
        if self.stream and self.prompt_logprobs is not None:
            # A stream has no place for them (vLLM refuses the pair as well).
            raise InvalidRequestError(
                "prompt_logprobs: not available with stream=true", "prompt_logprobs"
            )

    def structured_output_sources(self) -> list[tuple[str, StructuredOutputsParams]]:
        """Every constraint the body asks for, with the field that asked (at most one
        is allowed; the caller refuses more)."""
        sources = []
        if self.structured_outputs is not None:
            sources.append(
                ("structured_outputs", _spec("structured_outputs", self.structured_outputs))
            )
        legacy = {
            "guided_json": "json",
            "guided_regex": "regex",
            "guided_choice": "choice",
            "guided_grammar": "grammar",
        }
        for field_name, kind in legacy.items():
            value = getattr(self, field_name)
            if value is not None:
                sources.append((field_name, _spec(field_name, {kind: value})))
        if self.guided_decoding_backend not in (None, "xgrammar", "auto"):
            raise InvalidRequestError(
                f"guided_decoding_backend: {self.guided_decoding_backend!r} is not available; "
                "this server has 'xgrammar'",
                "guided_decoding_backend",
            )
        return sources

    def sampling_params(
        self, max_tokens: int | None, num_logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        try:
            logit_bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise InvalidRequestError("logit_bias: keys must be token ids", "logit_bias") from None
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=logit_bias or None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=num_logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


def _spec(field_name: str, value: dict[str, Any]) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{field_name}: must be an object", field_name)
    try:
        return StructuredOutputsParams(**value)
    except TypeError as error:
        raise InvalidRequestError(f"{field_name}: {error}", field_name) from None
    except ValueError as error:
        raise InvalidRequestError(f"{field_name}: {error}", field_name) from None


class CompletionRequest(SamplingRequest):
    # Token-id prompts are checked against the vocabulary, naming this field, when read.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: Int64 | None = None
    suffix: str | None = None
    best_of: Int64 | None = None
    add_special_tokens: bool = True

    def refused_fields(self) -> list[str]:
        refused = []
        if self.suffix is not None:
            refused.append("suffix")
        if self.best_of is not None and self.best_of != self.n:
            refused.append("best_of")
        return refused


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """An image or audio part is refused by its type, not with pydantic's message about
        every member of the union it failed."""
        if isinstance(value, list):
            for index, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise InvalidRequestError(
                        f"messages: content[{index}] is a {kind[:40]!r} part; this server "
                        "reads text parts only (type 'text')",
                        "messages",
                    )
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string."""
        message = self.model_dump(exclude_none=True, exclude={"content"})
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        else:
            message["content"] = self.content or ""
        return message


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def spec(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise InvalidRequestError(
                    "response_format: type json_schema needs json_schema.schema", "response_format"
                )
            return StructuredOutputsParams(json=self.json_schema.schema_)
        return None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False

    def refused_fields(self) -> list[str]:
        return []

    def structured_output_sources(self) -> list[tuple[str, StructuredOutputsParams]]:
        sources = super().structured_output_sources()
        spec = self.response_format.spec() if self.response_format is not None else None
        if spec is not None:
            sources.append(("response_format", spec))
        return sources

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class EmbeddingRequest(RequestBody):
    """`POST /v1/embeddings`: OpenAI's fields, then vLLM's extras (`normalize`, priority,
    salt, id). Token-id inputs are checked against the vocabulary when read."""

    # Shown in /docs, and sent by schema-driven clients and fuzzers as a body that works.
    model_config = ConfigDict(json_schema_extra={"examples": [{"input": "Say hello."}]})

    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None
    normalize: StrictBool | None = None  # "no" is not false
    add_special_tokens: bool = True
    priority: Int64 = 0
    cache_salt: str | None = None
    request_id: RequestId | None = None

    def check_stream_options(self) -> None:
        """Embeddings never stream: nothing to check."""


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(RequestBody):
    """`POST /v1/load_lora_adapter` (vLLM's fields): serve the PEFT adapter in the server's
    directory `lora_path` under the model name `lora_name`."""

    lora_name: str
    lora_path: str

    @field_validator("lora_name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        return check_lora_name(value, "lora_name")

    @field_validator("lora_path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        return check_lora_path(value, "lora_path")


class UnloadLoRAAdapterRequest(RequestBody):
    """`POST /v1/unload_lora_adapter` (vLLM's fields); `lora_int_id`, if given, must be the
    loaded adapter's id."""

    lora_name: str
    lora_int_id: Int64 | None = None
