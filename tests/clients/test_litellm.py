"""LiteLLM against `pagedllm serve` through its OpenAI-compatible provider
(`model="openai/<served name>"`, `api_base`, `api_key`), as LiteLLM's docs tell vLLM users:
chat, streaming, and a forced tool call."""

from __future__ import annotations

import json

from .common import API_KEY, MODEL, WEATHER_PROMPT, WEATHER_TOOL


def _completion(base_url: str, **kwargs):
    import litellm

    return litellm.completion(
        model=f"openai/{MODEL}", api_base=base_url, api_key=API_KEY, temperature=0, **kwargs
    )


def test_chat(base_url: str) -> None:
    response = _completion(base_url, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8)
    assert response.choices[0].message.content
    assert 0 < response.usage.completion_tokens <= 8


def test_chat_stream(base_url: str) -> None:
    stream = _completion(
        base_url, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_required_tool_call(base_url: str) -> None:
    response = _completion(
        base_url,
        messages=[{"role": "user", "content": WEATHER_PROMPT}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=64,
    )
    call = response.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert "city" in json.loads(call.function.arguments)
