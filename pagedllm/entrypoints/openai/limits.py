"""Limits on how a request arrives, enforced before anything parses it.

- Body size (`--max-request-body-bytes`): a declared `Content-Length` over the limit is
  refused before a byte of the body is read, and a chunked body is counted as it arrives and
  refused the moment it passes the limit (413), so a huge body never reaches the JSON parser
  and is never held beyond the limit.
- Body time (`--request-body-timeout`): the whole body must arrive within this many seconds
  of the headers (408, and the connection is closed).
- Header time (`--request-header-timeout`) and the header block's size
  (`--h11-max-incomplete-event-size`) are bounded in the HTTP protocol itself, before any
  request exists: `read_deadlines.py` and `http_protocols.py`.

The default body limit is sized from the context window: `max_model_len` tokens at a
generous 64 bytes each (a token is a few characters; JSON escapes such as `\\uXXXX` and
token-id lists stay well under that), plus 1 MiB for chat structure, tools and schemas.
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import error_response

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
            # before it does); the protocol's read deadline (read_deadlines.py) bounds how
            # long that may take.
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
