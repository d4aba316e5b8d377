"""LangChain's `ChatOpenAI(base_url=...)` against `pagedllm serve`: invoke, stream,
`bind_tools(..., tool_choice="required")` and `with_structured_output` in each of its
methods (json_schema, function_calling, json_mode)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from .common import API_KEY, EXTRACT_PROMPT, MODEL, WEATHER_PROMPT, Person, get_weather

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI


@pytest.fixture(scope="module")
def chat(base_url: str) -> ChatOpenAI:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL, base_url=base_url, api_key=API_KEY, max_tokens=32, temperature=0, max_retries=0
    )


def test_invoke(chat: ChatOpenAI) -> None:
    from langchain_core.messages import AIMessage

    message = chat.invoke("Say hi")
    assert isinstance(message, AIMessage) and message.content
    assert 0 < message.usage_metadata["output_tokens"] <= 32


def test_stream(chat: ChatOpenAI) -> None:
    chunks = list(chat.stream("Say hi"))
    assert len(chunks) > 2
    assert "".join(chunk.content for chunk in chunks)


def test_bind_tools_required(chat: ChatOpenAI) -> None:
    message = chat.bind_tools([get_weather], tool_choice="required").invoke(WEATHER_PROMPT)
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(chat: ChatOpenAI, method: str) -> None:
    person = chat.with_structured_output(Person, method=method).invoke(EXTRACT_PROMPT)
    assert isinstance(person, Person) and person.age == 30


def test_with_structured_output_json_mode(chat: ChatOpenAI) -> None:
    from langchain_core.messages import AIMessage, HumanMessage

    # json_mode sends `response_format: json_object` and no schema: the prompt must show
    # the shape, which a 135M model follows from one example turn.
    messages = [
        HumanMessage('Mary is 25 years old. Reply with JSON: {"name": ..., "age": ...}'),
        AIMessage('{"name": "Mary", "age": 25}'),
        HumanMessage('John is 30 years old. Reply with JSON: {"name": ..., "age": ...}'),
    ]
    person = chat.with_structured_output(Person, method="json_mode").invoke(messages)
    assert isinstance(person, Person) and person.age == 30
