"""Admission by cost and request-arrival limits.

Units: the admission queue takes all of an HTTP request's engine requests or none and gives
them back at their first token, on release, or when a dropped reservation is collected; the
body-limit middleware answers 413 before reading a declared oversized body and while counting
a chunked one, 408 to a slow body, and hands the app the body whole.

A server on a tiny model with small limits: a burst of 10x what the queue admits, as
concurrent requests and as multi-prompt requests, is answered 200 (complete) or 503 with
`Retry-After`; a request that can never fit gets a 503 naming the limit; the queued-token
limit refuses a second long prompt; oversized bodies get a 413 and slow headers or bodies are
cut off; afterwards KV usage is 0, the whole queue is free again and the API process's RSS is
within 10% of before.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx2 as httpx
import psutil
import pytest
from server_utils import RunningServer
from tiers import slow_fixture

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.limits import (
    BODY_BYTES_PER_TOKEN,
    BODY_EXTRA_BYTES,
    RequestLimitsMiddleware,
    default_max_request_body_bytes,
)
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.openai.serving import OpenAIServing
from pagedllm.frontend.admission import AdmissionQueue, Cost, QueueFullError, QueueLimits

QUEUE = 4  # --max-num-queued-requests
QUEUED_TOKENS = 300  # --max-num-queued-tokens
BODY_LIMIT = 256 * 1024  # --max-request-body-bytes
READ_TIMEOUT_S = 2  # --request-header-timeout and --request-body-timeout
SOCKET_TIMEOUT_S = 20.0  # no socket read in these tests waits longer


# ---- the admission queue ----------------------------------------------------------------------
LIMITS = QueueLimits(max_num_queued_requests=4, max_num_queued_tokens=100)


def test_admit_takes_all_or_nothing_and_releases_at_first_token():
    queue = AdmissionQueue()
    first = queue.admit({"a-0": Cost(2, 10), "a-1": Cost(1, 10)}, LIMITS)
    assert (queue.num_requests, queue.num_tokens) == (3, 20)
    with pytest.raises(QueueFullError) as error:  # 3 + 2 > 4: none of b's two is queued
        queue.admit({"b-0": Cost(1, 5), "b-1": Cost(1, 5)}, LIMITS)
    assert error.value.retry_after_s == 1 and "--max-num-queued-requests" in error.value.message
    assert (queue.num_requests, queue.num_tokens) == (3, 20)
    queue.first_token("a-0")
    assert (queue.num_requests, queue.num_tokens) == (1, 10)
    second = queue.admit({"b-0": Cost(1, 5), "b-1": Cost(1, 5)}, LIMITS)
    assert queue.num_requests == 3
    first.release()  # a-1 still queued: released with its reservation
    second.release()
    assert (queue.num_requests, queue.num_tokens) == (0, 0)


def test_tokens_limit_and_requests_that_can_never_fit():
    queue = AdmissionQueue()
    held = queue.admit({"a": Cost(1, 60)}, LIMITS)
    with pytest.raises(QueueFullError) as busy:
        queue.admit({"b": Cost(1, 60)}, LIMITS)
    assert busy.value.retry_after_s is not None and "--max-num-queued-tokens" in str(busy.value)
    held.release()
    for cost, param in ((Cost(5, 1), "n"), (Cost(1, 101), "prompt")):
        with pytest.raises(QueueFullError) as never:
            AdmissionQueue().admit({"c": cost}, LIMITS)
        assert never.value.retry_after_s is None and never.value.param == param
        assert "never be admitted" in never.value.message


def test_release_touches_only_its_own_entries_and_dropped_reservations_are_returned():
    queue = AdmissionQueue()
    stale = queue.admit({"x": Cost(1, 1)}, LIMITS)
    queue.release("x")  # its stream ended; the id is admitted again by another request
    current = queue.admit({"x": Cost(2, 2)}, LIMITS)
    stale.release()
    assert queue.num_requests == 2
    current.release()
    assert queue.num_requests == 0
    # A stream dropped before it started never runs its `finally`: collection releases it.
    queue.admit({"y": Cost(3, 3)}, LIMITS)
    gc.collect()
    assert (queue.num_requests, queue.num_tokens) == (0, 0)


def test_retry_after_follows_the_queue_wait():
    queue = AdmissionQueue()
    held = queue.admit({"a": Cost(1, 1)}, LIMITS)
    queue._entries["a"].admitted_at -= 9.5  # it waited 9.5 s for its first token
    queue.first_token("a")
    assert queue.retry_after_s == 10
    held.release()


@pytest.mark.parametrize(
    "queued,limit,dead,status",
    [(1, 1, False, 503), (0, 1, False, None), (0, None, True, 503), (5, None, False, None)],
)
def test_capacity_check(queued, limit, dead, status):
    """The early check (before tokenizing) refuses when not even one more request fits."""
    serving = OpenAIServing.__new__(OpenAIServing)
    admission = AdmissionQueue()
    admission.add("queued", Cost(queued, 1))
    serving.engine = SimpleNamespace(admission=admission, is_dead=dead, unavailable_reason=None)
    serving.queue_limits = QueueLimits(max_num_queued_requests=limit)
    if status is None:
        serving.check_capacity()
        return
    with pytest.raises(OpenAIError) as error:
        serving.check_capacity()
    assert error.value.status == status
    if not dead:
        assert error.value.headers == {"Retry-After": "1"}


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_num_queued_tokens", 0),
        ("max_request_body_bytes", 0),
        ("request_header_timeout", 0.0),
        ("request_body_timeout", float("inf")),
        ("request_body_timeout", float("nan")),
        ("h11_max_incomplete_event_size", 100),
    ],
)
def test_server_config_refuses_bad_limits(field, value):
    with pytest.raises(ValueError, match=field):
        ServerConfig(served_model_names=("m",), **{field: value})


def test_default_body_limit_grows_with_the_context_window():
    assert default_max_request_body_bytes(8192) == 8192 * BODY_BYTES_PER_TOKEN + BODY_EXTRA_BYTES
    # Room for a whole context of escaped text (`\uXXXX` for each of ~4 characters a token).
    assert default_max_request_body_bytes(8192) > 8192 * 4 * 6


# ---- the body-limit middleware ----------------------------------------------------------------
def run_middleware(headers: dict[str, str], messages: list[dict], delay_s: float = 0.0):
    """Drive `RequestLimitsMiddleware` (limit 100 bytes, 0.5 s) over an app that reads the
    whole body; returns (status, JSON body, what the app read, messages received)."""
    received: list[dict] = []
    sent: list[dict] = []
    app_body: list[bytes] = []

    async def receive() -> dict:
        if not messages:
            await asyncio.sleep(3600)
        if delay_s:
            await asyncio.sleep(delay_s)
        message = messages.pop(0)
        received.append(message)
        return message

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, app_receive, app_send) -> None:
        body = b""
        while True:
            message = await app_receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        app_body.append(body)
        await app_send({"type": "http.response.start", "status": 200, "headers": []})
        await app_send({"type": "http.response.body", "body": b"{}"})

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    middleware = RequestLimitsMiddleware(app, max_body_bytes=100, body_timeout_s=0.5)
    asyncio.run(asyncio.wait_for(middleware(scope, receive, send), 10))
    status = sent[0]["status"]
    payload = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    return status, payload, app_body, received


def chunk(body: bytes, more: bool) -> dict:
    return {"type": "http.request", "body": body, "more_body": more}


def test_declared_oversized_body_is_refused_before_it_is_read():
    status, payload, app_body, received = run_middleware(
        {"content-length": "29000000"}, [chunk(b"x" * 64, True)]
    )
    assert status == 413 and received == [] and app_body == []
    assert "100 bytes" in payload["error"]["message"]
    assert payload["error"]["code"] == 413


def test_chunked_body_is_counted_as_it_arrives():
    messages = [chunk(b"x" * 60, True), chunk(b"x" * 60, True), chunk(b"x" * 60, False)]
    status, payload, app_body, received = run_middleware({"transfer-encoding": "chunked"}, messages)
    assert status == 413 and app_body == [] and len(received) == 2  # stopped at the 2nd chunk
    assert "--max-request-body-bytes" in payload["error"]["message"]


def test_body_within_the_limit_reaches_the_app_whole():
    messages = [chunk(b'{"a":', True), chunk(b" 1}", False)]
    status, _, app_body, _ = run_middleware({"transfer-encoding": "chunked"}, messages)
    assert status == 200 and app_body == [b'{"a": 1}']


def test_slow_body_is_answered_408():
    messages = [chunk(b"x", True), chunk(b"x", True), chunk(b"x", False)]
    status, payload, app_body, _ = run_middleware({"content-length": "3"}, messages, delay_s=0.3)
    assert status == 408 and app_body == []
    assert payload["error"]["code"] == 408


# ---- against a server -------------------------------------------------------------------------
@pytest.fixture(scope="module")
@slow_fixture
def limited_server(tiny_llama, tmp_path_factory):
    args = [
        str(tiny_llama),
        "--max-num-seqs",
        str(QUEUE),
        "--max-num-queued-requests",
        str(QUEUE),
        "--max-num-queued-tokens",
        str(QUEUED_TOKENS),
        "--max-request-body-bytes",
        str(BODY_LIMIT),
        "--request-header-timeout",
        str(READ_TIMEOUT_S),
        "--request-body-timeout",
        str(READ_TIMEOUT_S),
        # The engine core is stopped while requests wait in the queue (`engine_stopped`): it
        # must never be reported stalled then, however slowly the test sends its burst.
        "--engine-iteration-timeout",
        "3600",
    ]
    server = RunningServer(args, tmp_path_factory.mktemp("admission") / "server.log")
    yield server
    assert server.stop() == 0, server.log()


def vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def completion(prompt, n: int = 1, max_tokens: int = 3) -> dict:
    return {"prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": 1}


def engine_core(server: RunningServer) -> psutil.Process:
    """The engine-core process: the API process's child started by multiprocessing's spawn."""
    children = psutil.Process(server.process.pid).children()
    return next(c for c in children if "spawn_main" in " ".join(c.cmdline()))


@contextlib.contextmanager
def engine_stopped(server: RunningServer):
    """The engine core suspended (SIGSTOP) until the block ends: a request admitted meanwhile
    gets no first token, so it stays in the admission queue however fast the machine would
    have run it. The core is resumed on the way out, a failed assertion included."""
    core = engine_core(server)
    core.suspend()
    try:
        yield
    finally:
        core.resume()


def burst(server: RunningServer, bodies: list[dict]) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: server.post("/v1/completions", b), bodies))


def burst_while_stopped(server: RunningServer, bodies: list[dict]) -> list[httpx.Response]:
    """Send every body at once while the engine core is stopped; the requests admitted wait
    in the queue, the others are answered at once. Once no more than the queue's worth is
    left unanswered, the core is resumed and the admitted ones finish."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        with engine_stopped(server):
            futures = [pool.submit(server.post, "/v1/completions", b) for b in bodies]
            deadline = time.monotonic() + 60
            while sum(not f.done() for f in futures) > QUEUE and time.monotonic() < deadline:
                time.sleep(0.05)
        return [f.result() for f in futures]


def check_answers(responses: list[httpx.Response], bodies: list[dict]) -> tuple[int, int]:
    """Every answer is a complete 200 or a 503 in OpenAI's shape with Retry-After."""
    accepted = refused = 0
    for response, body in zip(responses, bodies, strict=True):
        assert response.status_code in (200, 429, 503), response.text
        if response.status_code == 200:
            accepted += 1
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            choices = response.json()["choices"]
            assert len(choices) == len(prompts) * body["n"]
            assert all(c["finish_reason"] in ("length", "stop") for c in choices)
        else:
            refused += 1
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == response.status_code
            assert int(response.headers["Retry-After"]) >= 1
    return accepted, refused


def wait_until_idle(server: RunningServer) -> None:
    deadline = time.monotonic() + 60
    names = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")
    while any(server.metric(name) != 0 for name in names):
        assert time.monotonic() < deadline, {name: server.metric(name) for name in names}
        time.sleep(0.1)


def test_overload_and_oversized_bodies_leave_the_server_as_it_was(limited_server):
    server = limited_server
    # Warm up the paths the burst takes, then measure the API process (the engine core is
    # its child, with memory of its own).
    for _ in range(2):
        assert burst(server, [completion(["a", "b"], n=2)] * 2)[0].status_code in (200, 503)
    wait_until_idle(server)
    before_kib = vm_rss_kib(server.process.pid)

    # 10x what the queue admits, as concurrent single-prompt requests.
    singles = [completion(f"p{i}") for i in range(10 * QUEUE)]
    accepted, refused = check_answers(burst_while_stopped(server, singles), singles)
    print(f"burst of {len(singles)} single prompts: {accepted} answered 200, {refused} refused")
    assert accepted >= QUEUE and refused > 0, (accepted, refused)

    # ... as concurrent multi-prompt requests, each costing the whole queue (2 prompts x n=2).
    multis = [completion([f"q{i}", f"r{i}"], n=2) for i in range(10)]
    accepted, refused = check_answers(burst_while_stopped(server, multis), multis)
    print(f"burst of {len(multis)} 2-prompt n=2 requests: {accepted} answered, {refused} refused")
    assert accepted >= 1 and refused > 0, (accepted, refused)

    # ... and as one request: it can never be admitted, so no Retry-After.
    whole = server.post("/v1/completions", completion([f"s{i}" for i in range(10 * QUEUE)]))
    assert whole.status_code == 503 and "Retry-After" not in whole.headers
    assert "--max-num-queued-requests" in whole.json()["error"]["message"]

    # Queued prompt tokens: a second long prompt does not fit next to a waiting one.
    long_prompt = [7] * (QUEUED_TOKENS // 2 + 10)
    with contextlib.ExitStack() as streams:  # the core is resumed before the stream is read
        with engine_stopped(server):
            # A stream's 200 comes once it was admitted (a refusal is a 503 instead): from
            # then on it waits in the queue, since the stopped core gives it no first token.
            waiting = streams.enter_context(
                httpx.stream(
                    "POST",
                    server.base_url + "/v1/completions",
                    json={**completion(long_prompt), "stream": True},
                    headers=server.headers,
                    timeout=SOCKET_TIMEOUT_S,
                )
            )
            assert waiting.status_code == 200, waiting.read()
            second = server.post("/v1/completions", completion(long_prompt))
        waited = [line for line in waiting.iter_lines() if line]
    assert waited[-1] == "data: [DONE]", waited[-3:]
    assert not any('"error"' in line for line in waited), waited
    assert second.status_code == 503 and int(second.headers["Retry-After"]) >= 1
    assert "--max-num-queued-tokens" in second.json()["error"]["message"]
    too_long = server.post("/v1/completions", completion([7] * (QUEUED_TOKENS + 1)))
    assert too_long.status_code == 503 and too_long.json()["error"]["param"] == "prompt"

    # Bodies over the limit, declared and chunked: a 413 naming the limit.
    oversized = b'{"prompt": "' + b"x" * (32 * BODY_LIMIT) + b'"}'
    declared = httpx.post(
        server.base_url + "/v1/completions",
        content=oversized,
        headers={"content-type": "application/json"},
        timeout=SOCKET_TIMEOUT_S,
    )
    chunked = httpx.post(
        server.base_url + "/v1/completions",
        content=(oversized[i : i + 65536] for i in range(0, len(oversized), 65536)),
        headers={"content-type": "application/json"},
        timeout=SOCKET_TIMEOUT_S,
    )
    for response in (declared, chunked):
        assert response.status_code == 413, response.text
        assert str(BODY_LIMIT) in response.json()["error"]["message"]
    assert server.get("/health").status_code == 200

    wait_until_idle(server)
    # The whole queue is free again: a request that takes all of it is admitted.
    full = server.post("/v1/completions", completion(["t", "u"], n=2))
    assert full.status_code == 200 and len(full.json()["choices"]) == QUEUE
    after_kib = vm_rss_kib(server.process.pid)
    print(f"API process RSS: {before_kib} KiB before, {after_kib} KiB after")
    assert abs(after_kib - before_kib) <= 0.1 * before_kib, (before_kib, after_kib)


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_headers_and_slow_bodies_are_cut_off(limited_server):
    server = limited_server
    address = ("127.0.0.1", server.port)
    started = time.monotonic()
    # A connection that never sends a byte, and one that never finishes its headers.
    with socket.create_connection(address, SOCKET_TIMEOUT_S) as idle:
        assert read_until_closed(idle) == b""
    with socket.create_connection(address, SOCKET_TIMEOUT_S) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        answer = read_until_closed(slow)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"--request-header-timeout" in answer
    # Headers in time, then a body that stalls.
    with socket.create_connection(address, SOCKET_TIMEOUT_S) as stalled:
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n" + b'{"prompt": '
        )
        answer = read_until_closed(stalled)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"--request-body-timeout" in answer
    assert time.monotonic() - started < 3 * SOCKET_TIMEOUT_S
    assert server.get("/health").status_code == 200
    assert server.post("/v1/completions", completion("ok")).status_code == 200
