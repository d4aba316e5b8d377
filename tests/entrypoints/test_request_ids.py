"""Request ids scoped per tenant, without a server: the engine runs each tenant's id under
its own name, a duplicate in-flight id is refused within one tenant only, and errors name
the id the client sent, never the scoped one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pagedllm.entrypoints.openai.request_ids import client_error, engine_request_id
from pagedllm.entrypoints.openai.serving import OpenAIServing, Prompt
from pagedllm.entrypoints.openai.tenants import TenantRegistry, current_tenant
from pagedllm.errors import InvalidRequestError, RequestFailedError
from pagedllm.frontend.admission import AdmissionQueue, QueueLimits
from pagedllm.frontend.async_llm import AsyncLLM
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class FakeEngine:
    """The engine side `generations` uses, with `AsyncLLM`'s own duplicate-id check."""

    admit = AsyncLLM.admit

    def __init__(self) -> None:
        self._queues: dict[str, object] = {}
        self.admission = AdmissionQueue()
        self.engine_ids: list[str] = []

    def process_inputs(
        self, request_id, prompt, params, priority, tenant=None, lora_request=None,
        pooling_params=None,
    ):  # fmt: skip
        self.engine_ids.append(request_id)
        token_ids = prompt["prompt_token_ids"]
        return None, SimpleNamespace(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params
        )

    async def generate(self, _text, request):
        raise RequestFailedError(request.request_id, "a logits processor raised")
        yield  # an async generator, as AsyncLLM.generate


@pytest.fixture
def tenants(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice sk-alice\nbob sk-bob\n")
    registry = TenantRegistry([], str(path))
    return {name: registry.authenticate(f"Bearer sk-{name}") for name in ("alice", "bob")}


def serving_on(engine: FakeEngine) -> OpenAIServing:
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.engine = engine  # type: ignore[assignment]
    serving.queue_limits = QueueLimits(None, None)
    return serving


def start(serving: OpenAIServing, tenant, request_id: str, num_prompts: int = 1):
    """`generations` as `tenant` (its requests stay admitted: the stream is not read)."""
    prompts = [Prompt(None, [1, 2, 3])] * num_prompts
    params = [SamplingParams(max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY)]
    request = SimpleNamespace(cache_salt=None, priority=0, model="m")
    context = current_tenant.set(tenant)
    try:
        return serving.generations(request_id, prompts, params * num_prompts, request)
    finally:
        current_tenant.reset(context)


def test_engine_ids_are_scoped_by_tenant():
    assert engine_request_id(None, "a:b") == "a:b"  # no API keys: the id as sent
    assert engine_request_id("alice", "x") == "alice:x"
    # Tenant names hold no ":": the first one ends the tenant, whatever the id holds.
    assert engine_request_id("a-b", "c:d").partition(":") == ("a-b", ":", "c:d")


def test_tenants_may_share_an_in_flight_id_and_a_duplicate_is_refused_within_one(tenants):
    engine = FakeEngine()
    serving = serving_on(engine)
    held = [start(serving, tenants["alice"], "same")]  # in flight while held
    held.append(start(serving, tenants["bob"], "same"))  # another tenant's: not refused
    with pytest.raises(InvalidRequestError) as refused:
        start(serving, tenants["alice"], "same")
    assert str(refused.value) == "request_id 'same' is already running"
    assert refused.value.param == "request_id"
    held.append(start(serving, tenants["bob"], "other", num_prompts=2))
    with pytest.raises(InvalidRequestError) as refused:
        start(serving, tenants["bob"], "other-1")  # one of bob's own prompt ids
    assert str(refused.value) == "request_id 'other-1' is already running"
    assert engine.engine_ids[:2] == ["alice:same", "bob:same"]


def test_an_engine_failure_names_the_clients_id(tenants):
    serving = serving_on(FakeEngine())

    async def read(stream):
        return [item async for item in stream]

    with pytest.raises(RequestFailedError) as failed:
        asyncio.run(read(start(serving, tenants["alice"], "mine")))
    assert failed.value.request_id == "mine" and "alice" not in str(failed.value)
    assert str(failed.value) == "request mine failed in the engine: a logits processor raised"


def test_client_error_renames_only_the_scoped_id():
    error = InvalidRequestError("request_id 'a:x-1' is already running", "request_id")
    assert str(client_error(error, "a:x", "x")) == "request_id 'x-1' is already running"
    other = InvalidRequestError("prompt: empty", "prompt")
    assert client_error(other, "a:x", "x") is other
    failed = RequestFailedError("a:x#2", "boom")  # a forked sample of n > 1
    assert client_error(failed, "a:x", "x").request_id == "x#2"
