"""How the API process speaks HTTP: the parser, the event loop, and their limits.

The API process shares the cores with the engine, so what it spends parsing requests and
writing streams is taken from the model. By default (`--http auto`, `--loop auto`, as
uvicorn's) it runs httptools (llhttp, in C) on uvloop when they are installed, and h11 (pure
Python) on asyncio's loop otherwise or when asked. Either parser runs as a subclass of
uvicorn's protocol with the read deadlines of `read_deadlines.py` and a bound on the request
line and headers (`--h11-max-incomplete-event-size`, 16 KiB by default): h11 enforces it
itself; llhttp has none, so the httptools protocol counts what it buffers (below).

The subclasses rely on uvicorn's protocol internals (its callbacks, `cycle`, `conn`,
`pipeline`); tests/entrypoints/test_uvicorn_internals.py names each one, so a uvicorn
upgrade that changes them fails there first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.read_deadlines import ANSWERED_BODY, HEADERS, ReadDeadlines
from pagedllm.entrypoints.openai.server_config import ServerConfig

try:  # uvicorn's standard extras; without them the server runs h11 on asyncio's loop
    import httptools  # noqa: F401  (its presence is what `--http auto` asks about)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - the fallback environment
    HttpToolsProtocol = None
try:
    import uvloop
except ImportError:  # pragma: no cover - the fallback environment
    uvloop = None

logger = logging.getLogger("pagedllm")

# h11's own default bound on a header block (private in h11), for httptools as for h11.
DEFAULT_HEADER_BLOCK_BYTES = 16 * 1024


class LimitedH11Protocol(ReadDeadlines, H11Protocol):
    """uvicorn's h11 protocol with the read deadlines; h11 bounds the header block."""

    def _awaited(self) -> str | None:
        if self.conn.their_state is h11.IDLE:
            return HEADERS
        if self.conn.their_state is h11.SEND_BODY and self.cycle.response_complete:
            return ANSWERED_BODY
        return None  # the app is reading the body (RequestLimitsMiddleware times it) or answering


# Where the request being parsed stands (llhttp's callbacks move it along).
_BETWEEN, _HEADERS, _BODY = "between requests", "headers", "body"

if HttpToolsProtocol is not None:

    class LimitedHttpToolsProtocol(ReadDeadlines, HttpToolsProtocol):
        """uvicorn's httptools protocol with the read deadlines and a header-block bound.

        llhttp keeps no limit on a header block, and httptools holds a header's partial name
        and value itself, so the bound is kept on bytes read: every read that arrives while
        a request's line and headers are incomplete counts whole. A read that also finished
        the previous request is not counted (its share of the new request is unknown), so a
        pipelining client may pass the bound by at most one read before it is refused."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            configured = self.config.h11_max_incomplete_event_size
            self.max_header_bytes = configured or DEFAULT_HEADER_BLOCK_BYTES
            self._phase = _BETWEEN
            self._header_bytes = 0
            self._finished_in_read = False  # a request ended in the read being parsed

        def _awaited(self) -> str | None:
            if self.cycle is not None and not self.cycle.response_complete:
                return None  # the app is reading the body (the middleware times it) or answering
            return ANSWERED_BODY if self._phase == _BODY else HEADERS

        def data_received(self, data: bytes) -> None:
            self._finished_in_read = False
            super().data_received(data)
            if self._phase != _HEADERS or self._finished_in_read or self.transport.is_closing():
                return
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                logger.warning("Refusing request headers over %d bytes", self.max_header_bytes)
                self.send_400_response(
                    f"request line and headers are larger than this server's limit of "
                    f"{self.max_header_bytes} bytes (--h11-max-incomplete-event-size)"
                )

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._phase = _HEADERS
            self._header_bytes = 0

        def on_headers_complete(self) -> None:
            self._phase = _BODY
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._phase = _BETWEEN
            self._finished_in_read = True
            super().on_message_complete()


def _resolve(flag: str, name: str, fast: str, installed: bool, fallback: str) -> str:
    """`auto` is the `fast` package when installed, else `fallback`; naming `fast` when it
    is not installed is refused."""
    if name == "auto":
        return fast if installed else fallback
    if name == fast and not installed:
        raise ValueError(f"{flag} {fast}: {fast} is not installed (pip install {fast})")
    return name


def resolve_http_parser(name: str) -> str:
    """`--http`: "auto" is httptools when installed, else h11."""
    return _resolve("http", name, "httptools", HttpToolsProtocol is not None, "h11")


def resolve_event_loop(name: str) -> str:
    """`--loop`: "auto" is uvloop when installed, else asyncio's own."""
    return _resolve("loop", name, "uvloop", uvloop is not None, "asyncio")


def event_loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory for `asyncio.Runner` (None: asyncio's default loop)."""
    return uvloop.new_event_loop if resolve_event_loop(name) == "uvloop" else None


def protocol_class(config: ServerConfig) -> type[asyncio.Protocol]:
    """The protocol uvicorn runs for each connection, with this server's deadlines."""
    parser = resolve_http_parser(config.http)
    base = LimitedHttpToolsProtocol if parser == "httptools" else LimitedH11Protocol
    deadlines = {
        "header_timeout_s": config.request_header_timeout,
        "body_timeout_s": config.request_body_timeout,
    }
    return type(base.__name__, (base,), deadlines)


def uvicorn_limits(config: ServerConfig) -> dict[str, Any]:
    """uvicorn.Config arguments that pick the parser and bound how clients send requests."""
    return {
        "http": protocol_class(config),
        "h11_max_incomplete_event_size": config.h11_max_incomplete_event_size,
    }
