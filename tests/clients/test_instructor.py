"""instructor on the openai SDK against `pagedllm serve`: `from_openai(client, mode=...)`
extracting a validated pydantic model in JSON, JSON_SCHEMA and TOOLS modes.

MD_JSON is left out: it constrains nothing (a JSON block asked for in plain text), so it
tests the model's skill, not the server; the 135M default model rambles past max_tokens."""

from __future__ import annotations

import openai
import pytest

from .common import EXTRACT_PROMPT, MODEL, Person

# JSON puts the schema in a system message and asks for `json_object`: the default 135M
# model copies the schema back unless one example turn shows the answer's shape.
# JSON_SCHEMA (`response_format` json_schema) and TOOLS (a named tool_choice) constrain the
# output to the schema itself.
EXAMPLE_TURN = [
    {"role": "user", "content": "Mary is 25 years old. Extract the person."},
    {"role": "assistant", "content": '{"name": "Mary", "age": 25}'},
]


@pytest.mark.parametrize(
    "mode",
    ["JSON", "JSON_SCHEMA", "TOOLS"],  # instructor.Mode's names
)
def test_extracts_a_validated_model(openai_client: openai.OpenAI, mode: str) -> None:
    import instructor

    client = instructor.from_openai(openai_client, mode=instructor.Mode[mode])
    person = client.chat.completions.create(
        model=MODEL,
        response_model=Person,
        messages=[*EXAMPLE_TURN, {"role": "user", "content": EXTRACT_PROMPT}],
        max_tokens=64,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(person, Person)
    assert person.age == 30
