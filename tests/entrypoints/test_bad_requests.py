"""Validation at the edge, through the server: every value a client sends is checked against
the model before it reaches the engine. Each bad request below is sent as raw JSON (NaN,
Infinity, lone surrogates and integers wider than 64 bits cannot be written by a JSON
library) and must be a 400 in OpenAI's error shape naming the field; after each one
/health is 200 and a normal request is answered.

One server for the module and every other server test (the session's `server` fixture).
"""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest
from server_utils import MODEL

pytestmark = pytest.mark.slow

VOCAB = 49152  # the default model's vocabulary
HUGE = 2**70  # wider than any engine integer
MESSAGES = '"messages": [{"role": "user", "content": "hi"}]'


def chat(fields: str) -> str:
    return f'{{{MESSAGES}, "max_tokens": 2, {fields}}}'


def completion(fields: str) -> str:
    return f'{{"prompt": "hi", "max_tokens": 2, {fields}}}'


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def response_format(schema: dict) -> str:
    body = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return chat(f'"response_format": {json.dumps(body)}')


def tool_with(parameters: dict) -> str:
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    choice = {"type": "function", "function": {"name": "f"}}
    return chat(f'"tools": {json.dumps(tools)}, "tool_choice": {json.dumps(choice)}')


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
EMBEDDINGS, RESPONSES = "/v1/embeddings", "/v1/responses"

# (path, raw JSON body, the field the error must name: `param` starts with it)
CASES = {
    # Token ids within the vocabulary, in every field that carries them.
    "stop_token_ids with min_tokens": (
        CHAT,
        chat(f'"min_tokens": 1, "stop_token_ids": [{VOCAB}]'),
        "stop_token_ids",
    ),
    "allowed_token_ids": (CHAT, chat(f'"allowed_token_ids": [{VOCAB}]'), "allowed_token_ids"),
    "logit_bias key": (CHAT, chat(f'"logit_bias": {{"{VOCAB}": 1}}'), "logit_bias"),
    "logit_bias key not an id": (CHAT, chat('"logit_bias": {"x": 1}'), "logit_bias"),
    "logit_bias value": (CHAT, chat('"logit_bias": {"5": 101}'), "logit_bias"),
    "token-id prompt": (COMPLETIONS, f'{{"prompt": [1, {VOCAB}], "max_tokens": 2}}', "prompt"),
    "token-id prompts": (COMPLETIONS, '{"prompt": [[1, 2], [3, -1]], "max_tokens": 2}', "prompt"),
    "detokenize": ("/detokenize", f'{{"tokens": [1, {VOCAB}]}}', "tokens"),
    # A part this server cannot read is named by its type (not pydantic's union message).
    "image content part": (
        CHAT,
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, '
        '{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}], "max_tokens": 2}',
        "messages",
    ),
    # Integers within the engine's types.
    **{
        f"huge {field}": (CHAT, chat(f'"{field}": {HUGE}'), field)
        for field in (
            "n",
            "max_tokens",
            "max_completion_tokens",
            "seed",
            "top_k",
            "min_tokens",
            "top_logprobs",
            "prompt_logprobs",
            "truncate_prompt_tokens",
            "priority",
        )
    },
    **{
        f"int64 + 1 {field}": (CHAT, chat(f'"{field}": {2**63}'), field)
        for field in ("top_k", "truncate_prompt_tokens", "priority", "n")
    },
    "huge logprobs": (COMPLETIONS, completion(f'"logprobs": {HUGE}'), "logprobs"),
    "huge best_of": (COMPLETIONS, completion(f'"best_of": {HUGE}'), "best_of"),
    "huge token-id prompt": (COMPLETIONS, f'{{"prompt": [1, {HUGE}], "max_tokens": 2}}', "prompt"),
    "huge stop_token_ids": (CHAT, chat(f'"stop_token_ids": [{HUGE}]'), "stop_token_ids"),
    "huge allowed_token_ids": (CHAT, chat(f'"allowed_token_ids": [{HUGE}]'), "allowed_token_ids"),
    "huge logit_bias key": (CHAT, chat(f'"logit_bias": {{"{HUGE}": 1}}'), "logit_bias"),
    "huge detokenize": ("/detokenize", f'{{"tokens": [{HUGE}]}}', "tokens"),
    "seed at the top with n > 1": (CHAT, chat(f'"n": 2, "seed": {2**64 - 1}'), "seed"),
    "huge int in metadata": (CHAT, chat(f'"metadata": {{"x": {HUGE}}}'), "metadata"),
    # Floats finite and in range.
    **{
        f"{value} {field}": (CHAT, chat(f'"{field}": {value}'), field)
        for field, value in (
            ("temperature", "NaN"),
            ("temperature", "Infinity"),
            ("top_p", "NaN"),
            ("min_p", "-Infinity"),
            ("frequency_penalty", "NaN"),
            ("presence_penalty", "Infinity"),
            ("repetition_penalty", "NaN"),
        )
    },
    "NaN logit_bias value": (CHAT, chat('"logit_bias": {"5": NaN}'), "logit_bias"),
    "Infinity in a tool schema": (CHAT, tool_with({"type": "number", "maximum": 1e999}), "tools"),
    # Strings valid Unicode: a lone surrogate anywhere.
    "surrogate prompt": (COMPLETIONS, '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    "surrogate prompt list": (COMPLETIONS, '{"prompt": ["ok", "\\udc00"]}', "prompt"),
    "surrogate content": (
        CHAT,
        '{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}',
        "messages",
    ),
    "surrogate content part": (
        CHAT,
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        "messages",
    ),
    "surrogate stop": (CHAT, chat('"stop": ["\\ud800"]'), "stop"),
    "surrogate bad_words": (CHAT, chat('"bad_words": ["x\\ud800"]'), "bad_words"),
    "surrogate tool": (CHAT, tool_with({"type": "string", "description": "\ud800"}), "tools"),
    "surrogate key": (CHAT, chat('"metadata": {"\\ud800": 1}'), "metadata"),
    "surrogate tokenize": ("/tokenize", '{"prompt": "a\\ud800"}', "prompt"),
    # Found by the schemathesis run: no final message to continue was an IndexError (500).
    "continue nothing": (
        "/tokenize",
        '{"messages": [], "continue_final_message": true, "add_generation_prompt": false}',
        "continue_final_message",
    ),
    "surrogate regex": (CHAT, chat('"guided_regex": "a\\ud800"'), "guided_regex"),
    # Schemas and grammars bounded in depth and size; the body itself bounded in depth.
    "schema ~120 deep": (CHAT, response_format(nested_schema(120)), "response_format"),
    "schema 80 deep": (CHAT, response_format(nested_schema(40)), "response_format"),
    "guided_json text 80 deep": (
        CHAT,
        chat(f'"guided_json": {json.dumps(json.dumps(nested_schema(40)))}'),
        "guided_json",
    ),
    "structured_outputs json 80 deep": (
        CHAT,
        chat(f'"structured_outputs": {{"json": {json.dumps(nested_schema(40))}}}'),
        "structured_outputs",
    ),
    "tool parameters 80 deep": (CHAT, tool_with(nested_schema(40)), "tool_choice"),
    "schema too large": (
        CHAT,
        response_format({"enum": [f"value {i}" for i in range(8000)]}),
        "response_format",
    ),
    "regex too large": (CHAT, chat(f'"guided_regex": "{"a" * 70_000}"'), "guided_regex"),
    "regex nested too deep": (
        CHAT,
        chat(f'"guided_regex": "{"(" * 3000}a{")" * 3000}"'),
        "guided_regex",
    ),
    "choices too large": (
        CHAT,
        chat(f'"guided_choice": {json.dumps(["c" * 1000] * 70)}'),
        "guided_choice",
    ),
    "grammar too large": (
        CHAT,
        chat(f'"guided_grammar": {json.dumps("root ::= " + " | ".join(["x"] * 30_000))}'),
        "guided_grammar",
    ),
    "body 200 deep": (CHAT, chat(f'"metadata": {"[" * 200}{"]" * 200}'), "metadata"),
    # request_id bounded and visible ASCII (it is echoed in a header).
    "request_id too long": (CHAT, chat(f'"request_id": "{"x" * 300}"'), "request_id"),
    "request_id with CRLF": (CHAT, chat('"request_id": "a\\r\\nSet-Cookie: x=1"'), "request_id"),
    "request_id with a space": (CHAT, chat('"request_id": "a b"'), "request_id"),
    # "#" is how the engine names forked samples: "x#1" would collide with x's second.
    "request_id with #": (CHAT, chat('"request_id": "x#1"'), "request_id"),
    # Booleans and strings are not read as numbers or booleans.
    "stop_token_ids as booleans": (CHAT, chat('"stop_token_ids": [true]'), "stop_token_ids"),
    "embedding token ids as booleans": (EMBEDDINGS, '{"input": [true, false]}', "input"),
    "embedding normalize as a string": (
        EMBEDDINGS,
        '{"input": "hi", "normalize": "no"}',
        "normalize",
    ),
    "responses store as a string": (
        RESPONSES,
        '{"input": "hi", "max_output_tokens": 2, "store": "yes"}',
        "store",
    ),
    "previous_response_id of 100 KB": (
        RESPONSES,
        f'{{"input": "hi", "max_output_tokens": 2, "previous_response_id": "{"r" * 100_000}"}}',
        "previous_response_id",
    ),
}


def post_raw(server, path: str, body: str, headers: dict | None = None) -> httpx.Response:
    headers = {**server.headers, "Content-Type": "application/json", **(headers or {})}
    return httpx.post(server.base_url + path, content=body.encode(), headers=headers, timeout=60)


def assert_refused(response: httpx.Response, field: str | None, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["type"] == "BadRequestError"
    if field is not None:
        assert (error["param"] or "").startswith(field), error
        assert field in error["message"], error
    return error


def assert_still_serving(server) -> None:
    assert server.get("/health").status_code == 200
    answer = server.post(COMPLETIONS, {"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("case", list(CASES))
def test_bad_value_is_a_400_naming_the_field(server, case):
    path, body, field = CASES[case]
    assert_refused(post_raw(server, path, body), field)
    assert_still_serving(server)


@pytest.mark.parametrize(
    "body",
    [
        chat(f'"metadata": {"[" * 5000}{"]" * 5000}'),  # deeper than json.loads recurses
        chat(f'"seed": {"9" * 5000}'),  # more digits than Python converts
        chat('"temperature": 0.5,'),
    ],
    ids=["body 5000 deep", "5000-digit integer", "not JSON"],
)
def test_unparsable_body_is_a_400(server, body):
    assert_refused(post_raw(server, CHAT, body), None)
    assert_still_serving(server)


@pytest.mark.parametrize(
    "value",
    [b"x" * 300, b"a b", b"x#1", "\xe9t\xe9".encode("latin-1")],
    ids=["too long", "space", "hash", "latin-1"],
)
def test_bad_x_request_id_header_is_a_400_and_never_echoed(server, value):
    response = post_raw(server, COMPLETIONS, completion('"n": 1'), {"X-Request-Id": value})
    assert_refused(response, "X-Request-Id")
    assert response.headers["X-Request-Id"] != value.decode("latin-1")
    assert_still_serving(server)


def test_wrong_method_is_a_405_that_names_the_allowed_one(server):
    response = server.get(COMPLETIONS)
    assert response.status_code == 405
    assert response.headers["Allow"] == "POST"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_good_request_ids_are_echoed(server):
    response = post_raw(server, COMPLETIONS, completion('"n": 1'), {"X-Request-Id": "abc-1.2_x"})
    assert response.status_code == 200 and response.headers["X-Request-Id"] == "abc-1.2_x"
    response = post_raw(server, COMPLETIONS, completion('"request_id": "mine-7"'))
    assert response.status_code == 200 and response.headers["X-Request-Id"] == "mine-7"
    assert response.json()["id"] == "mine-7"


def test_values_at_the_limits_are_served(server):
    """Edge values are refused only past the limits: these are answered."""
    schema = nested_schema(31)  # 63 levels: objects and their "properties"
    bodies = [
        chat(f'"seed": {2**64 - 2}, "n": 2, "top_k": {2**63 - 1}, "priority": 0'),
        chat('"logit_bias": {"5": -100, "6": 100}, "temperature": 0'),
        response_format(schema),
        chat(f'"request_id": "{"r" * 256}"'),
        chat(f'"stop_token_ids": [{VOCAB - 1}], "min_tokens": 1'),
        chat(f'"metadata": {{"a": {"[" * 90}{"]" * 90}}}'),
    ]
    for body in bodies:
        response = post_raw(server, CHAT, body)
        assert response.status_code == 200, response.text


def test_an_image_part_is_refused_by_its_type(server):
    error = assert_refused(post_raw(server, CHAT, CASES["image content part"][1]), "messages")
    assert error["param"] == "messages"
    assert "'image_url' part" in error["message"] and "text parts only" in error["message"]
