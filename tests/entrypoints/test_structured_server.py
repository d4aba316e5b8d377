"""Structured output and tool calling through the server with the official `openai` client:
response_format and vLLM's fields constrain the answer; required and named tool choices
always return arguments that validate, streaming and not; auto with the hermes parser
returns tool_calls when the model writes a call and plain content otherwise; bad specs
are 400s that say what is wrong."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_utils import MODEL

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def check_calls(calls, names=("get_weather", "get_time")):
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def collect_stream(stream):
    """Tool calls rebuilt from streamed deltas, as OpenAI clients do, and the finish reason."""
    calls: dict[int, dict] = {}
    reason = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return calls, reason


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_always_validates(client, seed):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
        temperature=1.0, seed=seed, max_tokens=200,
    )  # fmt: skip
    choice = response.choices[0]
    check_calls(choice.message.tool_calls)
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_function_always_validates_streaming_and_not(client, seed):
    named = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                  temperature=1.0, seed=seed, max_tokens=200)  # fmt: skip
    response = client.chat.completions.create(**kwargs)
    check_calls(response.choices[0].message.tool_calls, names=("get_time",))
    calls, reason = collect_stream(client.chat.completions.create(**kwargs, stream=True))
    assert len(calls) == 1 and calls[0]["name"] == "get_time" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME)
    assert calls[0]["arguments"] == response.choices[0].message.tool_calls[0].function.arguments
    assert reason == "stop"


def test_required_streaming_returns_valid_calls(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", stream=True,
        temperature=1.0, seed=5, max_tokens=200, parallel_tool_calls=False,
    )  # fmt: skip
    calls, reason = collect_stream(stream)
    assert len(calls) == 1 and reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "Paris", "unit": "celsius"\}\}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_written_call_and_leaves_plain_text_alone(client, stream):
    # The guided regex makes the model write a hermes call (or plain text), which the
    # parser must then turn into tool_calls (or leave as content).
    def ask(pattern):
        kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto",
                      max_tokens=80, extra_body={"guided_regex": pattern})  # fmt: skip
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            return choice.message.content, calls, choice.finish_reason
        content, calls, reason = "", {}, None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            if chunk.choices:
                content += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
                for delta in chunk.choices[0].delta.tool_calls or []:
                    calls[delta.index] = (delta.function.name, delta.function.arguments)
        return content or None, list(calls.values()), reason

    content, calls, reason = ask(HERMES_CALL)
    assert calls == [("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))]
    assert content is None and reason == "tool_calls"
    content, calls, reason = ask("It is sunny in Paris today\\.")
    assert content == "It is sunny in Paris today." and calls == [] and reason == "stop"


def test_response_format_and_vllm_fields(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
              "required": ["answer"]}  # fmt: skip
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=100, temperature=1.0, seed=1,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "a", "schema": schema, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    ask_json = [{"role": "user", "content": 'Reply with a JSON object like {"city": "Rome"}.'}]
    obj = client.chat.completions.create(
        model=MODEL, messages=ask_json, max_tokens=200, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    for extra in ({"guided_choice": ["yes", "no"]},
                  {"structured_outputs": {"choice": ["yes", "no"]}}):  # fmt: skip
        text = (
            client.completions.create(
                model=MODEL, prompt="Is Paris in France?", max_tokens=5, extra_body=extra
            )
            .choices[0]
            .text
        )
        assert text in ("yes", "no")


@pytest.mark.parametrize(
    "extra,param,words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}, "response_format", "invalid JSON schema"),
        ({"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
        ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "invalid grammar"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "cannot be combined"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "no tool named"),
    ],
)  # fmt: skip
def test_bad_specs_are_400s_that_say_why(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=extra)
    body = error.value.body
    assert body["param"] == param and words in body["message"], body
