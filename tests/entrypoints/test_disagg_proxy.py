"""`pagedllm proxy` between two fake upstream servers (FastAPI apps in threads on 127.0.0.1)
that record what they receive: what each server sees, relaying, fallback, round-robin."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from process_guard import dies_with_us

from pagedllm.entrypoints.disagg_proxy import build_app, prefill_body
from pagedllm.utils import free_port

HOST = "127.0.0.1"
# A bound on waits that only guards against a hang: no outcome here depends on a delay being
# long or short enough, and an upstream told to "take this long" answers only at the end.
HANG_GUARD_S = 60.0
AUTH = {"Authorization": "Bearer sk-proxy-test"}
COMPLETION = {"model": "m", "prompt": "Hello", "max_tokens": 16, "temperature": 0.0}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "Hello"}],
    "max_completion_tokens": 16,
    "n": 2,
}


class ServerThread:
    """A uvicorn server for `app` in a daemon thread on a free port; `stop()` joins it."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        config = uvicorn.Config(
            app, host=HOST, port=self.port, log_level="warning", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(HANG_GUARD_S)
        assert not self.thread.is_alive()


class FakeUpstream:
    """An OpenAI-ish server that records each request (`arrived` is set at the first) and
    answers as told: a fixed status and body, after a delay (unless the client leaves first),
    or a stream of SSE events that pauses after the first one until the test sets `release`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[tuple[str, dict, dict]] = []  # (path, headers, JSON body)
        self.status = 200
        self.error_body: dict | None = None
        self.delay_s = 0.0
        self.health_status = 200
        self.release = threading.Event()
        self.arrived = threading.Event()
        self.stream_disconnected = threading.Event()
        self.disconnected = threading.Event()  # a client left while this server waited
        self.server = ServerThread(self._app())
        self.url = self.server.url

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> Response:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except ValueError:
                self.received.append((request.url.path, dict(request.headers), {"raw": raw}))
                return JSONResponse({"error": {"message": "not JSON"}}, status_code=400)
            self.received.append((request.url.path, dict(request.headers), body))
            self.arrived.set()
            deadline = time.monotonic() + self.delay_s
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    self.disconnected.set()
                    return Response(status_code=499)
                await asyncio.sleep(0.01)
            if self.status != 200:
                return JSONResponse(self.error_body, status_code=self.status)
            if body.get("stream"):
                return StreamingResponse(self._events(), media_type="text/event-stream")
            return JSONResponse({"id": "x", "server": self.name, "choices": [{"text": "hi"}]})

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            self.received.append((request.url.path, dict(request.headers), {}))
            return JSONResponse({"object": "list", "data": [{"id": self.name}]})

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=self.health_status)

        return app

    async def _events(self):
        try:
            yield b'data: {"n": 0}\n\n'
            while not self.release.is_set():
                await asyncio.sleep(0.01)
            for n in (1, 2):
                yield f'data: {{"n": {n}}}\n\n'.encode()
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.stream_disconnected.set()
            raise

    def bodies(self, path: str | None = None) -> list[dict]:
        return [body for p, _, body in self.received if path is None or p == path]


@pytest.fixture
def upstreams():
    prefill, decode = FakeUpstream("prefill"), FakeUpstream("decode")
    yield prefill, decode
    prefill.release.set()
    decode.release.set()
    prefill.server.stop()
    decode.server.stop()


def start_proxy(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 60.0):
    return ServerThread(build_app(prefill_urls, decode_urls, timeout_s))


@pytest.fixture
def proxy(upstreams):
    prefill, decode = upstreams
    server = start_proxy([prefill.url], [decode.url])
    yield server
    server.stop()


@pytest.fixture
def log(pagedllm_log):
    return pagedllm_log


def post(proxy, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(proxy.url + path, json=body, timeout=HANG_GUARD_S, **kwargs)


def leave_once_received(proxy, upstream: FakeUpstream) -> None:
    """POST COMPLETION to the proxy and hang up once `upstream` has the request: the client
    leaves while that server works on it, however fast or slow the machine."""
    payload = json.dumps(COMPLETION).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((HOST, proxy.port), timeout=HANG_GUARD_S) as client:
        client.sendall(head.encode() + payload)
        assert upstream.arrived.wait(HANG_GUARD_S), f"{upstream.name} never got the request"


def test_prefill_gets_one_token_and_decode_the_original_body(upstreams, proxy):
    prefill, decode = upstreams
    answer = post(proxy, "/v1/completions", COMPLETION, headers=AUTH)
    assert answer.status_code == 200 and answer.json()["server"] == "decode"
    assert prefill.bodies() == [{**COMPLETION, "max_tokens": 1, "stream": False, "n": 1}]
    assert decode.bodies() == [COMPLETION]
    # Each server saw the client's key.
    for server in upstreams:
        assert server.received[0][1]["authorization"] == AUTH["Authorization"]


def test_chat_prefill_caps_max_completion_tokens(upstreams, proxy):
    prefill, decode = upstreams
    assert post(proxy, "/v1/chat/completions", CHAT).status_code == 200
    (sent,) = prefill.bodies("/v1/chat/completions")
    assert sent["max_completion_tokens"] == 1 and sent["max_tokens"] == 1
    assert sent["n"] == 1 and sent["stream"] is False
    assert decode.bodies("/v1/chat/completions") == [CHAT]
    assert "authorization" not in prefill.received[0][1]  # none sent, none made up


def test_prefill_body_drops_stream_options_and_min_tokens():
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    body["min_tokens"] = 4
    assert prefill_body(body) == {**COMPLETION, "max_tokens": 1, "stream": False, "n": 1}
    assert body["stream_options"] == {"include_usage": True}  # the original is untouched


def test_stream_is_relayed_chunk_by_chunk(upstreams, proxy):
    prefill, decode = upstreams
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=10) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = answer.iter_lines()
        # The first event arrives while the decode server still holds back the rest.
        assert next(lines) == 'data: {"n": 0}'
        decode.release.set()
        rest = [line for line in lines if line]
    assert rest == ['data: {"n": 1}', 'data: {"n": 2}', "data: [DONE]"]
    assert decode.bodies() == [body]
    assert prefill.bodies()[0]["stream"] is False and "stream_options" not in prefill.bodies()[0]


def test_client_leaving_a_stream_closes_the_decode_stream(upstreams, proxy):
    _, decode = upstreams
    body = {**COMPLETION, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=10) as answer:
        assert next(answer.iter_lines()) == 'data: {"n": 0}'
    assert decode.stream_disconnected.wait(HANG_GUARD_S)


def test_client_leaving_during_prefill_cancels_it_and_skips_decode(upstreams, proxy):
    prefill, decode = upstreams
    prefill.delay_s = HANG_GUARD_S  # it answers only if the proxy never hangs up on it
    leave_once_received(proxy, prefill)
    assert prefill.disconnected.wait(HANG_GUARD_S)
    proxy.stop()  # the proxy's handlers have all ended: whatever it would send, it has sent
    assert decode.received == []


def test_client_leaving_during_decode_cancels_it(upstreams, proxy):
    _, decode = upstreams
    decode.delay_s = HANG_GUARD_S
    leave_once_received(proxy, decode)
    assert decode.disconnected.wait(HANG_GUARD_S)


def test_prefill_down_falls_back_to_decode_quickly(upstreams, log):
    _, decode = upstreams
    dead = f"http://{HOST}:{free_port()}"
    proxy = start_proxy([dead], [decode.url])
    try:
        answer = post(proxy, "/v1/completions", COMPLETION)
        assert answer.status_code == 200 and answer.json()["server"] == "decode"
        assert decode.bodies() == [COMPLETION]
        warnings = [r.getMessage() for r in log.records if "Prefill at" in r.getMessage()]
        assert len(warnings) == 1 and dead in warnings[0]
        # Quickly: on the refused connection, not at the end of the 60 s prefill timeout.
        assert "no answer within" not in warnings[0], warnings[0]
    finally:
        proxy.stop()


def test_prefill_timeout_falls_back_to_decode(upstreams, log):
    prefill, decode = upstreams
    prefill.delay_s = HANG_GUARD_S  # no answer within the proxy's 0.5 s, however slow it is
    proxy = start_proxy([prefill.url], [decode.url], timeout_s=0.5)
    try:
        answer = post(proxy, "/v1/completions", COMPLETION)
        assert answer.status_code == 200 and answer.json()["server"] == "decode"
        assert any("no answer within 0.5 s" in r.getMessage() for r in log.records)
    finally:
        proxy.stop()


def test_prefill_error_status_falls_back_to_decode(upstreams, proxy, log):
    prefill, decode = upstreams
    prefill.status, prefill.error_body = 500, {"error": {"message": "boom"}}
    answer = post(proxy, "/v1/completions", COMPLETION)
    assert answer.status_code == 200 and decode.bodies() == [COMPLETION]
    assert any("HTTP 500" in r.getMessage() for r in log.records)


@pytest.mark.parametrize("stream", [False, True])
def test_decode_error_is_relayed_as_is(upstreams, proxy, stream):
    _, decode = upstreams
    error = {"error": {"message": "max_tokens: too large", "type": "BadRequestError"}}
    decode.status, decode.error_body = 400, error
    answer = post(proxy, "/v1/completions", {**COMPLETION, "stream": stream})
    assert answer.status_code == 400
    assert answer.json() == error


def test_body_that_is_not_json_goes_to_decode_alone(upstreams, proxy):
    prefill, decode = upstreams
    answer = httpx.post(proxy.url + "/v1/completions", content=b"{not json", timeout=10)
    assert answer.status_code == 400 and answer.json() == {"error": {"message": "not JSON"}}
    assert prefill.received == [] and decode.bodies() == [{"raw": b"{not json"}]


def test_decode_down_is_a_502(upstreams):
    prefill, _ = upstreams
    proxy = start_proxy([prefill.url], [f"http://{HOST}:{free_port()}"])
    try:
        answer = post(proxy, "/v1/completions", COMPLETION)
        assert answer.status_code == 502
        assert answer.json()["error"]["code"] == 502
        assert httpx.get(proxy.url + "/health", timeout=10).status_code == 503
    finally:
        proxy.stop()


def test_models_and_health_come_from_decode(upstreams, proxy):
    prefill, decode = upstreams
    answer = httpx.get(proxy.url + "/v1/models", headers=AUTH, timeout=10)
    assert answer.status_code == 200 and answer.json()["data"] == [{"id": "decode"}]
    assert decode.received[0][1]["authorization"] == AUTH["Authorization"]
    assert httpx.get(proxy.url + "/health", timeout=10).status_code == 200
    decode.health_status = 503
    assert httpx.get(proxy.url + "/health", timeout=10).status_code == 503
    prefill.health_status = 503  # the prefill servers' health is not the proxy's
    decode.health_status = 200
    assert httpx.get(proxy.url + "/health", timeout=10).status_code == 200
    assert prefill.received == []


def test_several_servers_take_turns(upstreams):
    prefill, decode = upstreams
    prefill2, decode2 = FakeUpstream("prefill2"), FakeUpstream("decode2")
    proxy = start_proxy([prefill.url, prefill2.url], [decode.url, decode2.url])
    try:
        servers = [post(proxy, "/v1/completions", COMPLETION).json()["server"] for _ in range(4)]
        assert servers == ["decode", "decode2", "decode", "decode2"]
        assert len(prefill.received) == len(prefill2.received) == 2
    finally:
        proxy.stop()
        prefill2.server.stop()
        decode2.server.stop()


def test_cli_parses_repeated_urls():
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(
        ["proxy", "--prefill", "http://a:1", "--prefill", "http://b:2", "--decode", "http://c:3"]
    )
    assert args.prefill == ["http://a:1", "http://b:2"] and args.decode == ["http://c:3"]
    assert (args.host, args.port, args.prefill_timeout) == ("127.0.0.1", 8000, 60.0)
    proxy = build_parser()._subparsers._group_actions[0].choices["proxy"]
    assert all(action.help for action in proxy._actions)


@pytest.mark.slow  # `pagedllm proxy` in a process
def test_pagedllm_proxy_command_serves_and_exits_cleanly(upstreams, tmp_path):
    prefill, decode = upstreams
    port = free_port()
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "proxy"]
    command += ["--prefill", prefill.url, "--decode", decode.url, "--port", str(port)]
    log_path = tmp_path / "proxy.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=dies_with_us()
        )
    try:
        url = f"http://{HOST}:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "proxy did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        answer = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=HANG_GUARD_S)
        assert answer.json()["server"] == "decode" and len(prefill.received) == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(HANG_GUARD_S) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
