"""Limits on how a request arrives, enforced before anything parses it.

- Body size (`--max-request-body-bytes`): a declared `Content-Length` over the limit is
  refused before a byte of the body is read, and a chunked body is counted as it arrives and
  refused the moment it passes the limit (413), so a huge body never reaches the JSON parser
  and is never held beyond the limit.
- Body time (`--request-body-timeout`): the whole body must arrive within this many seconds
  of the headers (408, and the connection is closed).
- Header time (`--request-header-timeout`): from the moment the server waits for a request
  (a new connection, or a kept-alive one after its last response) the request line and
  headers must be complete within this many seconds, or the connection is closed. uvicorn
  has no such bound (its keep-alive timer restarts on every byte), so it lives in an h11
  protocol subclass; h11 itself bounds the size of a header block
  (`--h11-max-incomplete-event-size`).

The default body limit is sized from the context window: `max_model_len` tokens at a
generous 64 bytes each (a token is a few characters; JSON escapes such as `\\uXXXX` and
token-id lists stay well under that), plus 1 MiB for chat structure, tools and schemas.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.errors import error_body, error_response
from pagedllm.entrypoints.openai.server_config import ServerConfig

logger = logging.getLogger("pagedllm")

BODY_BYTES_PER_TOKEN = 64
BODY_EXTRA_BYTES = 1 << 20


def default_max_request_body_bytes(max_model_len: int) -> int:
    return BODY_BYTES_PER_TOKEN * max_model_len + BODY_EXTRA_BYTES


class RequestLimitsMiddleware:
    """Reads a request's body itself, within the size and time limits, then hands the app
    the body whole (one `http.request` message) and the connection's later events as they
    come (a disconnect still reaches the routes). Plain ASGI: nothing else is buffered."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if (declared is None or declared.strip() == "0") and not chunked:
            await self.app(scope, receive, send)  # no body to read
            return
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            # The rest of the body is left to uvicorn, which reads and drops it after the
            # answer, so the client can read the 413 (closing now could reset the connection
            # before it does); the h11 protocol below bounds how long that may take.
            await self._too_large(scope, receive, send)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return  # answered (413, 408) or the client left
        await self.app(scope, _Replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                await self._too_slow(scope, receive, send)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                chunks.clear()
                await self._too_large(scope, receive, send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"request body is larger than this server's limit of {self.max_body_bytes} bytes "
            "(--max-request-body-bytes)"
        )
        await error_response(413, message)(scope, receive, send)

    async def _too_slow(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"request body did not arrive within {self.body_timeout_s:g} s (--request-body-timeout)"
        )
        response = error_response(408, message, headers={"Connection": "close"})
        await response(scope, receive, send)


class _Replay:
    """The ASGI `receive` the app sees: the body read ahead, then the connection's own."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self._body: bytes | None = body
        self._receive = receive

    async def __call__(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None  # the app's copy is the only one kept
            return {"type": "http.request", "body": body, "more_body": False}
        return await self._receive()


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading: the headers of each request, and
    the rest of a body the server has already answered (which uvicorn reads and drops)."""

    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "headers" or "answered body"
        self._partial = False  # some bytes of the awaited headers arrived

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._update_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._partial = True
        self._update_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def _update_deadline(self) -> None:
        if self.transport is None or self.transport.is_closing():
            self._arm(None)
        elif self.conn.their_state is h11.IDLE:
            self._arm("headers")
        elif self.conn.their_state is h11.SEND_BODY and self.cycle.response_complete:
            self._arm("answered body")
        else:  # the app is reading the body (RequestLimitsMiddleware times it) or answering
            self._arm(None)

    def _arm(self, waiting_for: str | None) -> None:
        if waiting_for == self._waiting_for:
            return  # a deadline runs from when the wait began, not from the last byte
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._waiting_for = waiting_for
        if waiting_for is None:
            return
        self._partial = False
        timeout = self.header_timeout_s if waiting_for == "headers" else self.body_timeout_s
        self._deadline = self.loop.call_later(timeout, self._on_deadline)

    def _on_deadline(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._waiting_for == "headers" and self._partial:
            # h11 cannot answer a request it has not parsed: write the 408 ourselves.
            body = json.dumps(
                error_body(
                    408,
                    f"request headers did not arrive within {self.header_timeout_s:g} s "
                    "(--request-header-timeout)",
                )
            ).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
        logger.debug("Closing a connection slow to send its %s", self._waiting_for)
        self._waiting_for = None
        self.transport.close()


def uvicorn_limits(config: ServerConfig) -> dict[str, Any]:
    """uvicorn.Config arguments that bound how clients send requests."""
    protocol = type(
        "LimitedH11Protocol",
        (LimitedH11Protocol,),
        {
            "header_timeout_s": config.request_header_timeout,
            "body_timeout_s": config.request_body_timeout,
        },
    )
    return {
        "http": protocol,
        "h11_max_incomplete_event_size": config.h11_max_incomplete_event_size,
    }
