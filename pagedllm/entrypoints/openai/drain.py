"""The server's graceful shutdown: uvicorn's drain, ending what is left in OpenAI's shape.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections and waits for the open ones to
finish; its own `timeout_graceful_shutdown` then cancels the handlers, which answers a
plain-text 500 or cuts a stream short. `DrainingServer` ends every request still running
after `--shutdown-timeout` through the engine instead (`AsyncLLM.fail_all_requests`), so
each handler answers it as any other failure: a 503 with an OpenAI error body, or an error
event and `data: [DONE]` in a stream. uvicorn's cancel stays as a backstop `DRAIN_GRACE_S`
later, for a handler that cannot end (a client that stopped reading, say).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.frontend.async_llm import AsyncLLM

logger = logging.getLogger("pagedllm")

# How long after the requests were ended uvicorn waits for their handlers before cancelling.
DRAIN_GRACE_S = 5.0


def graceful_shutdown_timeout(shutdown_timeout: float) -> float:
    """uvicorn's `timeout_graceful_shutdown` for a drain of `shutdown_timeout` seconds."""
    return shutdown_timeout + DRAIN_GRACE_S


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.engine.begin_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self.shutdown_timeout, self._end_remaining)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _end_remaining(self) -> None:
        error = OpenAIError(
            503,
            "the server is shutting down and the request did not finish within its shutdown "
            f"timeout ({self.shutdown_timeout:g} s); retry it",
        )
        count = self.engine.fail_all_requests(error)
        if count:
            logger.warning(
                "Shutdown timeout (%g s) passed: ending %d request(s) with a 503",
                self.shutdown_timeout,
                count,
            )
