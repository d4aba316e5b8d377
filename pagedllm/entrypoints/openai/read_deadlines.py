"""Deadlines on how long a client may take to send, shared by both HTTP protocols.

uvicorn's keep-alive timer restarts on every byte, so a client sending its headers a byte at
a time (slowloris) holds a connection for ever. `ReadDeadlines` is mixed into each of
uvicorn's protocol classes (`http_protocols.py`) and keeps one timer per connection:

- "headers": from the moment the server waits for a request (a new connection, or a
  kept-alive one after its last response) the request line and headers must be complete
  within `header_timeout_s`; a client that sent part of them gets a 408, one that sent
  nothing is closed silently.
- "answered body": the rest of a body the server has already answered (uvicorn reads and
  drops it so the client can read the answer) must arrive within `body_timeout_s`.

A deadline runs from when the wait began: bytes arriving do not move it. The body the app
reads is timed by `RequestLimitsMiddleware` (limits.py), not here. Each protocol says what
its connection waits for (`_awaited`); everything else is here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from pagedllm.entrypoints.openai.errors import error_body

logger = logging.getLogger("pagedllm")

HEADERS = "headers"
ANSWERED_BODY = "answered body"


def header_timeout_response(timeout_s: float) -> bytes:
    """The 408 written when headers stall: no parser has a request to answer yet."""
    message = f"request headers did not arrive within {timeout_s:g} s (--request-header-timeout)"
    body = json.dumps(error_body(408, message)).encode()
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )


class ReadDeadlines:
    """Mixed in before a uvicorn protocol class; uses its `loop` and `transport`."""

    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # HEADERS, ANSWERED_BODY or None
        self._partial = False  # some bytes of the awaited headers arrived

    def _awaited(self) -> str | None:
        """What the connection waits for from the client, in the protocol's own state."""
        raise NotImplementedError

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._update_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        self._partial = True
        self._update_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._update_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)  # type: ignore[misc]

    def _update_deadline(self) -> None:
        if self.transport is None or self.transport.is_closing():
            self._arm(None)
        else:
            self._arm(self._awaited())

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
        timeout = self.header_timeout_s if waiting_for == HEADERS else self.body_timeout_s
        self._deadline = self.loop.call_later(timeout, self._on_deadline)

    def _on_deadline(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._waiting_for == HEADERS and self._partial:
            self.transport.write(header_timeout_response(self.header_timeout_s))
        logger.debug("Closing a connection slow to send its %s", self._waiting_for)
        self._waiting_for = None
        self.transport.close()
