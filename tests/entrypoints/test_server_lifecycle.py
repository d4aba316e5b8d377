"""Server lifecycle on a tiny model: SIGTERM drains in-flight work and exits 0; a dead engine
turns /health to 503, fails in-flight requests with a 500 and ends the server non-zero (a full
queue's 503: `test_admission.py`)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
from server_utils import RunningServer, queue_is_full, wait_until

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.serving import OpenAIServing


def start_long_request(server: RunningServer, max_tokens: int) -> dict:
    """POST a long completion in a thread; returns a dict that gets its response."""
    result: dict = {}
    body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}

    def run() -> None:
        result["response"] = server.post("/v1/completions", body)

    result["thread"] = threading.Thread(target=run)
    result["thread"].start()
    deadline = time.monotonic() + 60
    while server.metric("num_requests_running") < 1:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.02)
    return result


def engine_process(server: RunningServer) -> psutil.Process:
    children = psutil.Process(server.process.pid).children()
    return next(c for c in children if "spawn_main" in " ".join(c.cmdline()))


@pytest.mark.slow  # a server
def test_sigterm_drains_in_flight_request_then_exits_zero(tiny_llama, tmp_path):
    args = [str(tiny_llama), "--shutdown-timeout", "120", "--served-model-name", "a", "b"]
    server = RunningServer(args, tmp_path / "log")
    assert [m["id"] for m in server.get("/v1/models").json()["data"]] == ["a", "b"]
    body = {"model": "b", "prompt": "hi", "max_tokens": 2}
    assert server.post("/v1/completions", body).json()["model"] == "a"
    pending = start_long_request(server, max_tokens=600)
    server.process.send_signal(signal.SIGTERM)
    pending["thread"].join(120)
    response = pending["response"]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 600
    assert server.process.wait(60) == 0, server.log()
    server.stop()


@pytest.mark.slow  # a server
def test_dead_engine_gives_503_health_500_in_flight_and_nonzero_exit(tiny_llama, tmp_path):
    # A queue of one: the request's admission (it stays queued without a first token) is seen
    # from outside without a model step.
    server = RunningServer([str(tiny_llama), "--max-num-queued-requests", "1"], tmp_path / "log")
    engine = engine_process(server)
    try:
        # Stopped before the request is sent, so it is certainly still owed when the core
        # dies, however fast the model would have finished it.
        engine.suspend()
        result: dict = {}
        body = {"prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}

        def run() -> None:
            result["response"] = server.post("/v1/completions", body)

        thread = threading.Thread(target=run)
        thread.start()
        wait_until(lambda: queue_is_full(server), "the request admitted", 60)
        engine.kill()  # SIGKILL ends a stopped process too
        thread.join(60)
        assert result["response"].status_code == 500, result["response"].text
        assert "engine" in result["response"].json()["error"]["message"]
        health = server.get("/health")  # the server answers a little while before it exits
        assert health.status_code == 503
        assert server.post("/v1/completions", {"prompt": "hi"}).status_code == 503
        assert server.process.wait(60) != 0
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):  # a failed assertion left it stopped
            if engine.status() == psutil.STATUS_STOPPED:
                engine.resume()
        server.stop()


@pytest.mark.parametrize("allow", [False, True])
def test_unknown_fields_refused_or_logged(allow, caplog):
    from pagedllm.entrypoints.openai.protocol import CompletionRequest

    serving = OpenAIServing.__new__(OpenAIServing)
    serving.config = SimpleNamespace(allow_unknown_fields=allow)
    request = CompletionRequest.model_validate({"prompt": "x", "vendor_knob": 3})
    if not allow:
        with pytest.raises(OpenAIError) as error:
            serving.check_unknown(request)
        assert error.value.status == 400 and error.value.param == "vendor_knob"
    else:
        serving.check_unknown(request)
        assert "vendor_knob" in caplog.text
