"""Both HTTP parsers keep the read deadlines and the header-block bound (issue 46).

One uvicorn server in this process per parser, as `pagedllm serve` configures it
(`uvicorn_limits`, `RequestLimitsMiddleware`), in front of an app that reads the body and
answers its size: httptools on uvloop (the default) and h11 on asyncio's loop (the
fallback). Against each: a connection that sends nothing, one that stops in its headers, one
that sends its headers a byte at a time (slowloris), a body that stalls, the unread rest of a
body answered 413, header blocks over the bound, and the deadline re-armed on a kept-alive
connection. The choice itself (`--http`, `--loop`) is checked without a server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import BinaryIO

import pytest
import uvicorn
from tiers import slow_fixture

from pagedllm.entrypoints.openai import http_protocols
from pagedllm.entrypoints.openai.http_protocols import (
    LimitedH11Protocol,
    LimitedHttpToolsProtocol,
    event_loop_factory,
    resolve_event_loop,
    resolve_http_parser,
    uvicorn_limits,
)
from pagedllm.entrypoints.openai.limits import RequestLimitsMiddleware
from pagedllm.entrypoints.openai.server_config import ServerConfig

# --request-header-timeout and --request-body-timeout: long enough that a client on loaded
# cores sends what it means to before the deadline, short enough to wait for it.
READ_TIMEOUT_S = 1.0
HEADER_LIMIT = 1024  # --h11-max-incomplete-event-size
BODY_LIMIT = 4096  # --max-request-body-bytes
SOCKET_TIMEOUT_S = 10.0  # no socket read here waits longer
SLOWLORIS_GAP_S = 0.05  # between a slow client's bytes: twenty of them per deadline
PARSERS = [("httptools", "uvloop"), ("h11", "asyncio")]


async def body_size_app(scope, receive, send) -> None:
    """Reads the whole body and answers its size."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = json.dumps({"bytes": size}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class InProcessServer:
    """uvicorn on its own event loop in a thread, on a socket bound to a free port."""

    def __init__(self, http: str, loop: str) -> None:
        config = ServerConfig(
            served_model_names=("m",),
            http=http,
            loop=loop,
            request_header_timeout=READ_TIMEOUT_S,
            request_body_timeout=READ_TIMEOUT_S,
            h11_max_incomplete_event_size=HEADER_LIMIT,
        )
        app = RequestLimitsMiddleware(body_size_app, BODY_LIMIT, READ_TIMEOUT_S)
        self.options = uvicorn_limits(config)
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", timeout_keep_alive=30, **self.options)
        )
        self.loop = loop
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=event_loop_factory(self.loop)) as runner:
            runner.run(self.server.serve(sockets=[self.sock]))

    def start(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + SOCKET_TIMEOUT_S
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(SOCKET_TIMEOUT_S)
        self.sock.close()
        assert not self.thread.is_alive(), "server did not stop"

    def connect(self) -> socket.socket:
        return socket.create_connection(self.address, SOCKET_TIMEOUT_S)


@pytest.fixture(scope="module", params=PARSERS, ids=[parser for parser, _ in PARSERS])
@slow_fixture
def server(request):
    running = InProcessServer(*request.param).start()
    yield running
    running.stop()


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass  # closed with unread bytes of ours: what was answered before still counts
    return data


def read_response(reader: BinaryIO) -> tuple[bytes, bytes]:
    """One response with a content-length: (status line and headers, body), read from the
    socket's buffered file, so responses that arrive together are read one at a time."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = reader.readline()
        assert line, f"closed before a response: {head!r}"
        head += line
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return head, reader.read(length)


def post(path: str, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\ncontent-length: %d\r\n\r\n%s" % (
        path.encode(),
        len(body),
        body,
    )


def test_the_chosen_protocol_runs(server):
    expected = LimitedHttpToolsProtocol if server.loop == "uvloop" else LimitedH11Protocol
    assert issubclass(server.options["http"], expected)
    assert server.options["http"].header_timeout_s == READ_TIMEOUT_S
    with server.connect() as sock:
        sock.sendall(post("/", b"0123456789"))
        head, body = read_response(sock.makefile("rb"))
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"bytes": 10}


def test_a_connection_that_sends_nothing_is_closed(server):
    with server.connect() as idle:
        assert read_until_closed(idle) == b""


def test_headers_that_stop_get_a_408(server):
    with server.connect() as slow:
        slow.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")
        answer = read_until_closed(slow)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"--request-header-timeout" in answer


def test_headers_sent_a_byte_at_a_time_are_cut_off(server):
    """Slowloris: each byte comes well inside the deadline, the whole block never would.
    The deadline runs from the connection's start, so the server closes it part way."""
    request = post("/", b"{}")
    request = request[:-4] + b"x-padding: " + b"p" * 100 + b"\r\n" + request[-4:]
    sent = 0
    with server.connect() as slow:
        try:
            for byte in request:
                slow.sendall(bytes([byte]))
                sent += 1
                time.sleep(SLOWLORIS_GAP_S)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_until_closed(slow)
    assert sent < len(request), "the whole request went through at a byte every 50 ms"
    assert answer.startswith(b"HTTP/1.1 408"), answer


def test_a_body_that_stalls_gets_a_408(server):
    with server.connect() as stalled:
        stalled.sendall(b"POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\n{")
        answer = read_until_closed(stalled)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"--request-body-timeout" in answer


def test_the_rest_of_an_answered_body_is_bounded_in_time(server):
    """A declared body over the limit is answered 413 before it is read; the connection
    then waits for the rest, which never comes, and is closed."""
    with server.connect() as sock:
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\ncontent-length: %d\r\n\r\n" % (64 * BODY_LIMIT)
        )
        reader = sock.makefile("rb")
        head, body = read_response(reader)
        assert head.startswith(b"HTTP/1.1 413"), head
        assert str(BODY_LIMIT) in json.loads(body)["error"]["message"]
        assert reader.read() == b""


def test_a_chunked_body_over_the_limit_gets_a_413(server):
    chunk = b"%x\r\n%s\r\n" % (1024, b"x" * 1024)
    with server.connect() as sock:
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n" + chunk * 5
        )
        head, _ = read_response(sock.makefile("rb"))
    assert head.startswith(b"HTTP/1.1 413"), head


@pytest.mark.parametrize("pieces", [1, 4])
def test_a_header_block_over_the_bound_gets_a_400(server, pieces):
    """Whether it comes in one read or several, an unfinished header block past the bound is
    refused; a request within it on the same server is served."""
    block = b"POST / HTTP/1.1\r\nHost: x\r\nx-padding: " + b"p" * (2 * HEADER_LIMIT)
    step = len(block) // pieces + 1
    with server.connect() as sock:
        try:
            for start in range(0, len(block), step):
                sock.sendall(block[start : start + step])
                time.sleep(0.02)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    with server.connect() as sock:
        sock.sendall(post("/", b"{}"))
        assert read_response(sock.makefile("rb"))[0].startswith(b"HTTP/1.1 200")


def test_a_kept_alive_connection_gets_the_header_deadline_again(server):
    """The deadline is re-armed after each response: two pipelined requests are served, then
    a third that stops in its headers gets its 408."""
    with server.connect() as sock:
        sock.sendall(post("/", b"ab") + post("/", b"abc"))
        reader = sock.makefile("rb")
        sizes = [json.loads(read_response(reader)[1])["bytes"] for _ in range(2)]
        sock.sendall(b"GET / HTTP/1.1\r\n")
        answer = reader.read()
    assert sizes == [2, 3]
    assert answer.startswith(b"HTTP/1.1 408"), answer


# ---- the choice, without a server -------------------------------------------------------------
def test_auto_picks_httptools_on_uvloop_when_installed():
    assert resolve_http_parser("auto") == "httptools"
    assert resolve_event_loop("auto") == "uvloop"
    assert resolve_http_parser("h11") == "h11" and resolve_event_loop("asyncio") == "asyncio"
    assert event_loop_factory("asyncio") is None
    loop = event_loop_factory("auto")()
    try:
        assert type(loop).__module__.startswith("uvloop")
    finally:
        loop.close()


def test_without_the_fast_pair_auto_falls_back_and_naming_it_is_refused(monkeypatch):
    monkeypatch.setattr(http_protocols, "HttpToolsProtocol", None)
    monkeypatch.setattr(http_protocols, "uvloop", None)
    assert resolve_http_parser("auto") == "h11"
    assert resolve_event_loop("auto") == "asyncio"
    with pytest.raises(ValueError, match="httptools is not installed"):
        resolve_http_parser("httptools")
    with pytest.raises(ValueError, match="uvloop is not installed"):
        resolve_event_loop("uvloop")


@pytest.mark.parametrize(
    "http,base", [("auto", LimitedHttpToolsProtocol), ("h11", LimitedH11Protocol)]
)
def test_uvicorn_gets_the_chosen_protocol_with_the_server_deadlines(http, base):
    config = ServerConfig(served_model_names=("m",), http=http, request_header_timeout=7.0)
    options = uvicorn_limits(config)
    assert issubclass(options["http"], base)
    assert (options["http"].header_timeout_s, options["http"].body_timeout_s) == (7.0, 60.0)


@pytest.mark.parametrize("field", ["http", "loop"])
def test_server_config_refuses_an_unknown_parser_or_loop(field):
    with pytest.raises(ValueError, match=field):
        ServerConfig(served_model_names=("m",), **{field: "tornado"})
