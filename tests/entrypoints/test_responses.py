"""`POST /v1/responses` through the official `openai` client and raw HTTP on the session
server (`--responses-store-size 16`): greedy answers equal the chat completion's for the same
messages, streams send OpenAI's typed events in order, function tools and `text.format`
JSON schemas constrain the answer, `previous_response_id` continues a conversation, and
what the server does not do is a 400 naming the field."""

from __future__ import annotations

import json

import httpx2 as httpx
import jsonschema
import pytest
from server_utils import API_KEY, MODEL, RunningServer
from tiers import slow_fixture

from pagedllm.entrypoints.openai.app import LIMITED_PATHS

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
OTHER_KEY = "sk-other-tenant"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now",
    "parameters": WEATHER,
}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]
TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def greedy_chat(client, messages, max_tokens: int):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens
    )


def greedy_response(client, max_output_tokens: int, **kwargs):
    return client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=max_output_tokens, **kwargs
    )


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of the same delta event folded into one."""
    folded: list[str] = []
    for event_type in types:
        if not (folded and folded[-1] == event_type and event_type.endswith(".delta")):
            folded.append(event_type)
    return folded


def test_text_input_equals_chat_completion(client):
    response = greedy_response(client, 12, input=QUESTION)
    chat = greedy_chat(client, [{"role": "user", "content": QUESTION}], 12)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL
    assert response.output_text == chat.choices[0].message.content
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    finished = chat.choices[0].finish_reason
    assert response.status == ("completed" if finished == "stop" else "incomplete")


def test_instructions_and_message_items_equal_chat_with_a_system_message(client):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi, I am Ann."}]},
        {"type": "message", "role": "assistant", "content": "Hello Ann!"},
        {"role": "user", "content": "What is my name?"},
    ]
    response = greedy_response(client, 10, input=items, instructions="Answer in one line.")
    chat = greedy_chat(
        client,
        [
            {"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": "Hi, I am Ann."},
            {"role": "assistant", "content": "Hello Ann!"},
            {"role": "user", "content": "What is my name?"},
        ],
        10,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.instructions == "Answer in one line."


def test_max_output_tokens_cut_is_incomplete(client):
    response = greedy_response(client, 2, input=QUESTION)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2
    assert response.output[0].status == "incomplete"


def test_stream_sends_typed_events_in_order(client):
    stream = greedy_response(client, 12, input=QUESTION, stream=True)
    events = list(stream)
    types = [event.type for event in events]
    status = events[-1].response.status
    final = {"completed": "response.completed", "incomplete": "response.incomplete"}[status]
    expected = ["response.created", "response.in_progress", *TEXT_EVENTS, final]
    assert collapse(types) == expected
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # The same greedy answer as without streaming, and the same count of tokens.
    plain = greedy_response(client, 12, input=QUESTION)
    assert text == plain.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens


def test_forced_function_call_and_its_round_trip(client):
    response = greedy_response(
        client, 60, input=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER
    )
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # The call and its result sent back: the same answer as chat's tool round trip.
    result = '{"temperature": 21}'
    items = [
        *ASK_WEATHER,
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]  # fmt: skip
    answer = greedy_response(client, 12, input=items, tools=[WEATHER_TOOL], tool_choice="none")
    tool_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            *ASK_WEATHER,
            {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result},
        ],
        tools=[{"type": "function", "function": {k: WEATHER_TOOL[k] for k in WEATHER_TOOL
                                                 if k != "type"}}],
        tool_choice="none",
        temperature=0,
        max_tokens=12,
    )  # fmt: skip
    assert answer.output[0].type == "message"
    assert answer.output_text == chat.choices[0].message.content


def test_streamed_function_call(client):
    stream = greedy_response(
        client, 60, input=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="required", stream=True
    )
    events = list(stream)
    types = collapse([event.type for event in events])
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done.arguments == deltas
    jsonschema.validate(json.loads(done.arguments), WEATHER)
    [call] = events[-1].response.output
    assert call.type == "function_call" and call.arguments == done.arguments


def test_json_schema_text_format(client):
    text_format = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    for stream in (False, True):
        kwargs = dict(input=ASK_WEATHER, text={"format": text_format}, stream=stream)
        if stream:
            events = list(greedy_response(client, 60, **kwargs))
            response = events[-1].response
        else:
            response = greedy_response(client, 60, **kwargs)
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), WEATHER)
        assert response.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(client):
    first = greedy_response(client, 8, input=QUESTION)
    assert first.store is True
    second = greedy_response(
        client, 8, input="And of Italy?", previous_response_id=first.id, instructions="Be brief."
    )
    assert second.previous_response_id == first.id
    chat = greedy_chat(
        client,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And of Italy?"},
        ],
        8,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # A streamed answer is kept too; instructions are not carried into a follow-up.
    events = list(
        greedy_response(client, 8, input="And Spain?", previous_response_id=second.id, stream=True)
    )
    third = events[-1].response
    chat = greedy_chat(
        client,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And of Italy?"},
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "And Spain?"},
        ],
        8,
    )
    assert third.output_text == chat.choices[0].message.content
    fourth = greedy_response(client, 2, input="Thanks", previous_response_id=third.id)
    assert fourth.usage.input_tokens > third.usage.input_tokens


def test_store_false_keeps_nothing(server):
    body = {"input": QUESTION, "max_output_tokens": 2, "store": False}
    response = server.post("/v1/responses", body)
    assert response.status_code == 200, response.text
    assert response.json()["store"] is False
    follow_up = {"input": "More", "max_output_tokens": 2}
    follow_up["previous_response_id"] = response.json()["id"]
    refused = server.post("/v1/responses", follow_up)
    assert refused.status_code == 404, refused.text
    assert refused.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "fields,status,param",
    [
        ({"background": True}, 400, "background"),
        ({"reasoning": {"effort": "low"}}, 400, "reasoning"),
        ({"include": ["file_search_call.results"]}, 400, "include"),
        ({"truncation": "auto"}, 400, "truncation"),
        ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"max_output_tokens": 10**6}, 400, "max_output_tokens"),
        ({"temperature": 3}, 400, "temperature"),
        ({"top_p": "x"}, 400, "top_p"),
        ({"stream_options": {"include_obfuscation": False}}, 400, "stream_options"),
        ({"model": "nope"}, 404, "model"),
        ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, 400,
         "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         400, "input[0].content[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0].type"),
        ({"input": [{"role": "wizard", "content": "x"}]}, 400, "input[0].role"),
        ({"input": []}, 400, "input"),
        ({"metadata": {"k": "v" * 513}}, 400, "metadata"),
        ({"tools": [WEATHER_TOOL, {**WEATHER_TOOL, "x": 1}]}, 400, "tools[1].name"),
        ({"tools": [{**WEATHER_TOOL, "name": {}}]}, 400, "tools.0.name"),
        ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "3"}]}, 400,
         "input[0].call_id"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(server, fields, status, param):
    body = {"input": QUESTION, "max_output_tokens": 2, **fields}
    response = server.post("/v1/responses", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"]
    assert error["param"] == param, error


@pytest.fixture(scope="module")
@slow_fixture
def two_tenants(tmp_path_factory):
    """A server keeping one response per key, for two keys, each with one request at a time."""
    log = tmp_path_factory.mktemp("responses-server") / "server.log"
    args = ["--max-num-seqs", "4", "--responses-store-size", "1", "--api-key", OTHER_KEY]
    args += ["--tenant-max-concurrent-requests", "1"]
    running = RunningServer(args, log, api_key=API_KEY)
    yield running
    assert running.stop() == 0, running.log()


def post(server, key: str, **fields) -> httpx.Response:
    body = {"input": QUESTION, "max_output_tokens": 2, **fields}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(server.base_url + "/v1/responses", json=body, headers=headers, timeout=120)


def test_store_is_per_key_and_least_recently_used_out(two_tenants):
    first = post(two_tenants, API_KEY)
    assert first.status_code == 200, first.text
    first_id = first.json()["id"]
    other = post(two_tenants, OTHER_KEY, previous_response_id=first_id)
    assert other.status_code == 404 and other.json()["error"]["param"] == "previous_response_id"
    second = post(two_tenants, API_KEY, previous_response_id=first_id)
    assert second.status_code == 200, second.text
    # One response kept per key: the second pushed the first out.
    dropped = post(two_tenants, API_KEY, previous_response_id=first_id)
    assert dropped.status_code == 404, dropped.text
    kept = post(two_tenants, API_KEY, previous_response_id=second.json()["id"])
    assert kept.status_code == 200, kept.text
    assert kept.json()["usage"]["input_tokens"] > second.json()["usage"]["input_tokens"]


def test_responses_are_under_the_tenant_limits(two_tenants):
    assert "/v1/responses" in LIMITED_PATHS
    # At least 64 numbers: the answer cannot end before the refused request is sent.
    numbers = {"type": "array", "items": {"type": "integer"}, "minItems": 64}
    text = {"format": {"type": "json_schema", "name": "numbers", "schema": numbers}}
    body = {"input": "Count.", "max_output_tokens": 200, "stream": True, "text": text}
    url = two_tenants.base_url + "/v1/responses"
    with httpx.stream("POST", url, json=body, headers=two_tenants.headers, timeout=120) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped iterator would close the stream
        assert next(lines) == "event: response.created"  # the key's one slot is taken
        refused = post(two_tenants, API_KEY)
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"]
        assert post(two_tenants, OTHER_KEY).status_code == 200  # another tenant's own slot
