"""The openai SDK against `pagedllm serve`, as a vLLM user calls it: completions, chat,
streaming, tools with `tool_choice` required and named, `response_format` json_schema, and
the `json_object` + `schema` shape that older instructor releases send.

Embeddings need a `--runner pooling` server; tests/entrypoints/test_embeddings_server.py
drives `client.embeddings.create` there."""

from __future__ import annotations

import json

import openai
import pytest

from .common import EXTRACT_PROMPT, MODEL, WEATHER_PROMPT, WEATHER_TOOL, Person


def test_completion(openai_client: openai.OpenAI) -> None:
    response = openai_client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert "Paris" in response.choices[0].text
    assert response.usage.completion_tokens == 8 or response.choices[0].finish_reason == "stop"


def test_chat(openai_client: openai.OpenAI) -> None:
    response = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0
    )
    message = response.choices[0].message
    assert message.role == "assistant" and message.content
    assert response.usage.completion_tokens <= 8


def test_chat_stream_with_usage(openai_client: openai.OpenAI) -> None:
    stream = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 8


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_tool_choice_forces_a_call(openai_client: openai.OpenAI, tool_choice) -> None:
    response = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": WEATHER_PROMPT}],
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        max_tokens=64,
        temperature=0,
    )
    calls = response.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


def test_response_format_json_schema(openai_client: openai.OpenAI) -> None:
    response = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": EXTRACT_PROMPT}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "Person", "schema": Person.model_json_schema()},
        },
        max_tokens=64,
        temperature=0,
    )
    person = Person.model_validate_json(response.choices[0].message.content)
    assert person.age == 30


def test_structured_parse_helper(openai_client: openai.OpenAI) -> None:
    # The SDK's own structured-output helper: a strict json_schema, parsed into the model.
    completion = openai_client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": EXTRACT_PROMPT}],
        response_format=Person,
        max_tokens=64,
        temperature=0,
    )
    assert isinstance(completion.choices[0].message.parsed, Person)


# Older instructor releases (JSON_SCHEMA mode before 1.4) put the schema beside
# `type: json_object`. vLLM, like OpenAI, reads json_object as "any JSON object" and ignores
# the schema (a warning names it; --strict-request-fields makes it a 400): so does this server.
def test_json_object_beside_a_schema_answers_any_json_object(openai_client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"animal": {"type": "string", "enum": ["zebra"]}},
        "required": ["animal"],
    }
    response = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour, as JSON."}],
        response_format={"type": "json_object", "schema": schema},  # type: ignore[typeddict-unknown-key]
        max_tokens=64,
        temperature=0,
    )
    content = response.choices[0].message.content
    # json_object is enforced (the answer opens an object; 64 tokens may end it early), the
    # schema beside it is not: the one answer it allows is not what the model writes.
    assert content.lstrip().startswith("{")
    assert "zebra" not in content
