"""The responses store (`previous_response_id`), without a server: per-tenant LRU bounds,
tenants kept apart, the 400s when it is off, and input items read as chat messages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.responses_store import ResponsesStore, StoredResponse
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.tenants import current_tenant


def stored(response_id: str, text: str = "hi") -> StoredResponse:
    return StoredResponse(response_id, ({"role": "user", "content": text},))


def test_each_tenant_keeps_its_last_n_least_recently_used_out():
    store = ResponsesStore(2)
    for response_id in ("a", "b"):
        store.put("t1", stored(response_id))
    assert store.get("t1", "a") is not None  # now the most recently used
    store.put("t1", stored("c"))
    assert store.get("t1", "b") is None
    assert store.get("t1", "a") is not None and store.get("t1", "c") is not None
    for response_id in ("x", "y"):
        store.put("t2", stored(response_id))
    assert len(store) == 4  # another tenant's responses never push out t1's


def test_tenants_never_see_each_others_responses():
    store = ResponsesStore(4)
    store.put("t1", stored("resp_1", "secret"))
    assert store.get("t2", "resp_1") is None
    assert store.get("t1", "resp_1").messages[0]["content"] == "secret"


@pytest.mark.parametrize("size", [0, -1])
def test_store_size_must_be_positive(size):
    with pytest.raises(ValueError, match="responses_store_size"):
        ResponsesStore(size)


def test_server_config_refuses_a_negative_store_size():
    with pytest.raises(ValueError, match="responses_store_size"):
        ServerConfig(served_model_names=("m",), responses_store_size=-1)
    assert ServerConfig(served_model_names=("m",)).responses_store_size == 0


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


@pytest.mark.parametrize(
    "fields,param",
    [({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id")],
)
def test_without_a_store_its_fields_are_refused_by_name(fields, param):
    serving = OpenAIServingResponses(chat=None, store=None)  # type: ignore[arg-type]
    with pytest.raises(OpenAIError) as refused:
        serving._history(request(**fields))
    assert refused.value.status == 400 and refused.value.param == param
    assert "--responses-store-size" in refused.value.message
    assert serving._history(request(store=False)) == []
    assert not serving._will_store(request())


def test_previous_response_id_is_looked_up_in_the_callers_tenant():
    store = ResponsesStore(2)
    serving = OpenAIServingResponses(chat=None, store=store)  # type: ignore[arg-type]
    store.put("key-1", stored("resp_1", "earlier"))
    token = current_tenant.set(SimpleNamespace(name="key-1"))
    try:
        history = serving._history(request(previous_response_id="resp_1"))
    finally:
        current_tenant.reset(token)
    assert history == [{"role": "user", "content": "earlier"}]
    token = current_tenant.set(SimpleNamespace(name="key-2"))
    try:
        with pytest.raises(OpenAIError) as refused:
            serving._history(request(previous_response_id="resp_1"))
    finally:
        current_tenant.reset(token)
    assert refused.value.status == 404 and refused.value.param == "previous_response_id"
    assert serving._will_store(request()) and not serving._will_store(request(store=False))


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "a"},
                                          {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "2"}]},
    ]  # fmt: skip
    messages = request(input=items).input_messages()
    assert messages[0] == {"role": "developer", "content": "ab"}
    assert messages[1]["role"] == "assistant" and messages[1]["content"] == "Let me look."
    assert [call["id"] for call in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["tool_calls"][1]["function"] == {"name": "g", "arguments": '{"x": 1}'}
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
    ]
    assert request().input_messages() == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "fields,refused",
    [
        ({"background": False, "include": [], "truncation": "disabled"}, []),
        ({"background": 0}, ["background"]),  # 0 is not False
        ({"top_logprobs": 2, "reasoning": {}}, ["reasoning", "top_logprobs"]),
    ],
)
def test_fields_this_server_does_not_do(fields, refused):
    assert sorted(request(**fields).refused_fields()) == refused
