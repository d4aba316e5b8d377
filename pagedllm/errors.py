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
