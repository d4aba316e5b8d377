"""A request that fails alone in the engine core gets a 500 in OpenAI's error shape (an error
event then `[DONE]` when streaming); the requests beside it answer 200 with the tokens they
produce without the fault, the engine core stays up, and the next request is answered.

The fault is the model runner's test-only hook: with `PAGEDLLM_INJECT_FAULT_SEED=<seed>` in
the engine-core process's environment, a request with that seed raises in its logits stage."""

from __future__ import annotations

import json
import threading

import pytest
from server_utils import RunningServer
from tiers import slow_fixture

FAULT_SEED = 424242
PROMPTS = [[(11 * i + 5 * j) % 400 + 3 for j in range(6 + 3 * i)] for i in range(4)]
FAULTY = 1


def body(prompt: list[int], **extra) -> dict:
    return {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
@slow_fixture
def faulty_server(tiny_llama, tmp_path_factory):
    env = pytest.MonkeyPatch()
    env.setenv("PAGEDLLM_INJECT_FAULT_SEED", str(FAULT_SEED))  # inherited by the core process
    try:
        running = RunningServer([str(tiny_llama)], tmp_path_factory.mktemp("fault") / "log")
    finally:
        env.undo()
    yield running
    assert running.stop() == 0, running.log()


def post_concurrently(server, bodies: list[dict]) -> list:
    responses: list = [None] * len(bodies)

    def send(index: int) -> None:
        responses[index] = server.post("/v1/completions", bodies[index])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return responses


def text(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_faulty_request_gets_500_and_its_neighbours_their_tokens(faulty_server):
    alone = [text(faulty_server.post("/v1/completions", body(p))) for p in PROMPTS]
    bodies = [body(p) for p in PROMPTS]
    bodies[FAULTY] = body(PROMPTS[FAULTY], seed=FAULT_SEED)
    responses = post_concurrently(faulty_server, bodies)
    failed = responses[FAULTY]
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    assert "injected fault" in error["message"]
    for index, response in enumerate(responses):
        if index != FAULTY:
            assert text(response) == alone[index]
    assert faulty_server.get("/health").status_code == 200
    assert text(faulty_server.post("/v1/completions", body(PROMPTS[0]))) == alone[0]
    assert faulty_server.metric("kv_cache_usage_perc") == 0.0


def test_faulty_stream_gets_an_error_event_then_done(faulty_server):
    response = faulty_server.post(
        "/v1/completions", body(PROMPTS[FAULTY], seed=FAULT_SEED, stream=True)
    )
    assert response.status_code == 200
    events = [line[len("data: ") :] for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "injected fault" in error["message"]
    assert faulty_server.get("/health").status_code == 200
    assert faulty_server.post("/v1/completions", body(PROMPTS[2])).status_code == 200
