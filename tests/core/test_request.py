"""`core.request`: the scheduler's request built from the core's message, and request ids."""

from __future__ import annotations

from pagedllm.core.messages import EngineCoreRequest
from pagedllm.core.request import (
    CHILD_SEPARATOR,
    Request,
    RequestStatus,
    child_request_id,
    family_id,
    is_child_request,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


def test_from_core_request_carries_every_field():
    lora = LoRARequest("adapter", 1, "/nowhere")
    message = EngineCoreRequest(
        "r",
        [1, 2, 3],
        SamplingParams(max_tokens=4),
        [7, 8],
        12.5,
        priority=3,
        cache_salt="salt",
        bad_words_token_ids=[[5]],
        tenant="alice",
        lora_request=lora,
        pooling_params=PoolingParams(),
    )
    request = Request.from_core_request(message)
    assert request.eos_token_ids == frozenset({7, 8})
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    # Every field of the message is the request's own, under the same name: a field added
    # to one and not the other fails here.
    for name in EngineCoreRequest.__struct_fields__:
        value = getattr(request, name)
        expected = getattr(message, name)
        assert (frozenset(expected) if name == "eos_token_ids" else expected) == value, name


def test_parallel_sample_ids_and_their_family():
    ids = [child_request_id("p", index) for index in range(3)]
    assert ids == ["p", f"p{CHILD_SEPARATOR}1", f"p{CHILD_SEPARATOR}2"]
    assert [is_child_request(i) for i in ids] == [False, True, True]
    assert {family_id(i) for i in ids} == {"p"}
