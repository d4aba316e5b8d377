"""Tool schemas as `tool_choice: "required"` constrains them: each tool's local definitions
(`$defs`, `definitions`) still resolve once its parameters sit inside the array of calls,
so a schema that named tools and response_format accept compiles here too."""

from __future__ import annotations

import jsonschema
import pytest

from pagedllm.entrypoints.openai.tool_calls import plan_tools
from pagedllm.structured_output.validation import validate_structured_outputs

CITY = {"type": "string", "minLength": 1, "maxLength": 20}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    tool(
        "get_weather",
        {
            "type": "object",
            "properties": {"place": {"$ref": "#/$defs/Place"}},
            "required": ["place"],
            "$defs": {
                "Place": {
                    "type": "object",
                    "properties": {"city": {"$ref": "#/$defs/City"}},
                    "required": ["city"],
                },
                "City": CITY,
            },
        },
    ),
    # The same local name in another tool means another thing.
    tool(
        "get_time",
        {
            "type": "object",
            "properties": {"place": {"$ref": "#/definitions/Place"}},
            "required": ["place"],
            "definitions": {"Place": {"type": "string", "enum": ["utc", "local"]}},
        },
    ),
]


def test_required_keeps_each_tools_local_definitions():
    spec = plan_tools(TOOLS, "required", None, None).constraint()
    validate_structured_outputs(spec, "tools")  # compiles (a 400 before)
    good = [
        {"name": "get_weather", "arguments": {"place": {"city": "Paris"}}},
        {"name": "get_time", "arguments": {"place": "utc"}},
    ]
    jsonschema.validate(good, spec.json)
    for bad in (
        [{"name": "get_weather", "arguments": {"place": {"city": ""}}}],
        [{"name": "get_time", "arguments": {"place": {"city": "Paris"}}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, spec.json)
