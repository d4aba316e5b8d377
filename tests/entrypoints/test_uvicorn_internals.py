"""The private uvicorn classes the server's HTTP protocols subclass, one test each (issue 46).

uvicorn keeps no promise about `uvicorn.protocols.http.h11_impl.H11Protocol` and
`uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`: `http_protocols.py` overrides
their callbacks (`connection_made`, `data_received`, `on_response_complete`,
`connection_lost`; httptools' `on_message_begin`, `on_headers_complete`,
`on_message_complete`) and reads their state (`conn.their_state`, `cycle.response_complete`,
`config`, `loop`, `transport`, `send_400_response`). Each test drives one protocol through a
request on a fake transport, without a server, and checks what the read deadline waits for
at each step; a failure names uvicorn's version and the class, so an upgrade meets it here
instead of as a connection that is never cut off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from uvicorn.server import ServerState

from pagedllm.entrypoints.openai.http_protocols import uvicorn_limits
from pagedllm.entrypoints.openai.limits import RequestLimitsMiddleware
from pagedllm.entrypoints.openai.read_deadlines import ANSWERED_BODY, HEADERS
from pagedllm.entrypoints.openai.server_config import ServerConfig

CLASSES = {
    "h11": "uvicorn.protocols.http.h11_impl.H11Protocol",
    "httptools": "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol",
}
BODY_LIMIT = 16


@contextmanager
def internal(http: str) -> Iterator[None]:
    """Any failure inside becomes one that says what changed, where, and in which uvicorn."""
    try:
        yield
    except Exception as error:
        pytest.fail(
            f"uvicorn {uvicorn.__version__}: {CLASSES[http]} no longer behaves as "
            f"pagedllm/entrypoints/openai/http_protocols.py expects ({type(error).__name__}: "
            f"{error}); check it before moving the uvicorn range",
            pytrace=False,
        )


class FakeTransport(asyncio.Transport):
    """What a protocol writes, and whether it closed the connection."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def answer_ok(scope, receive, send) -> None:
    while (await receive()).get("more_body"):
        pass
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


def new_protocol(
    http: str, loop: asyncio.AbstractEventLoop, header_limit: int | None
) -> asyncio.Protocol:
    config = ServerConfig(
        served_model_names=("m",), http=http, h11_max_incomplete_event_size=header_limit
    )
    limits = uvicorn_limits(config)
    app = RequestLimitsMiddleware(answer_ok, BODY_LIMIT, 30.0)
    config = uvicorn.Config(app, log_config=None, **limits)
    return limits["http"](config=config, server_state=ServerState(), app_state={}, _loop=loop)


async def until_answered(transport: FakeTransport) -> None:
    for _ in range(1000):
        if b"\r\n\r\n" in transport.written:
            await asyncio.sleep(0)  # the response's last callbacks
            return
        await asyncio.sleep(0)
    raise AssertionError(f"no response: {bytes(transport.written)!r}")


def drive(http: str, scenario, header_limit: int | None = 1024) -> None:
    async def run() -> None:
        protocol = new_protocol(http, asyncio.get_running_loop(), header_limit)
        transport = FakeTransport()
        protocol.connection_made(transport)
        try:
            await scenario(protocol, transport)
        finally:
            protocol.connection_lost(None)

    with internal(http):
        asyncio.run(run())


@pytest.mark.parametrize("http", CLASSES)
def test_the_header_deadline_runs_from_the_wait_and_is_rearmed_after_a_response(http):
    async def scenario(protocol, transport: FakeTransport) -> None:
        assert protocol._waiting_for == HEADERS, "no header deadline on a new connection"
        first = protocol._deadline
        protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\n")
        assert protocol._deadline is first, "a byte of the headers moved the deadline"
        protocol.data_received(b"content-length: 5\r\n\r\nhello")
        await until_answered(transport)
        assert transport.written.startswith(b"HTTP/1.1 200"), bytes(transport.written)
        assert protocol._waiting_for == HEADERS, "the kept-alive connection waits unbounded"
        assert protocol._deadline is not first, "the next request's deadline is the old one"

    drive(http, scenario)


@pytest.mark.parametrize("http", CLASSES)
def test_the_rest_of_an_answered_body_gets_the_body_deadline(http):
    async def scenario(protocol, transport: FakeTransport) -> None:
        protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 1000\r\n\r\nab")
        await until_answered(transport)
        assert transport.written.startswith(b"HTTP/1.1 413"), bytes(transport.written)
        assert protocol._waiting_for == ANSWERED_BODY, protocol._waiting_for

    drive(http, scenario)


@pytest.mark.parametrize("http", CLASSES)
@pytest.mark.parametrize(
    "header_limit,padding,refused",
    # The default bound (None) is h11's 16 KiB for both parsers.
    [(1024, 2048, True), (None, 15 * 1024, False), (None, 17 * 1024, True)],
)
def test_a_header_block_over_the_bound_is_refused(http, header_limit, padding, refused):
    async def scenario(protocol, transport: FakeTransport) -> None:
        protocol.data_received(b"GET / HTTP/1.1\r\nx-padding: " + b"p" * padding)
        if refused:
            assert transport.written.startswith(b"HTTP/1.1 400"), bytes(transport.written)
        else:
            assert transport.written == b"" and protocol._waiting_for == HEADERS
        assert transport.closed == refused

    drive(http, scenario, header_limit)
