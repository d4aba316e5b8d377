"""The project's own exception types, in one leaf module every layer may import.

Callers anywhere (the frontend's checks, structured-output validation, the server's error
mapping) raise or catch these without importing the modules that happen to raise them.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A ValueError that names the request field at fault (the server's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine-core process exited; nothing in flight can finish."""


class RequestFailedError(RuntimeError):
    """The engine failed one request (its logits processors, grammar, parallel-sample fork or
    detokenization raised); that request alone ends, the engine and other requests go on."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed in the engine: {message}")
        self.request_id = request_id
        self.message = message


def describe_error(error: BaseException) -> str:
    """An exception in one line, for a failed request's message: its type and first line."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
