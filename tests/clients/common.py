"""What several clients' tests ask the server for: a person to extract, a weather tool, and
the prompts that make the 135M default model answer them.

The client packages are imported inside the tests, not at module level: collecting this
folder (also for `make test-fast`, which then leaves it out) should not cost their imports'
seconds."""

from __future__ import annotations

from typing import Any

from entrypoints.server_utils import API_KEY, MODEL
from pydantic import BaseModel, Field

__all__ = ["API_KEY", "MODEL", "Person", "get_weather"]

EXTRACT_PROMPT = "John is 30 years old. Extract the person."
WEATHER_PROMPT = "What is the weather in Paris?"


class Person(BaseModel):
    # A bounded name: structured output on a tiny model must end even if it rambles.
    name: str = Field(max_length=20)
    age: int


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
