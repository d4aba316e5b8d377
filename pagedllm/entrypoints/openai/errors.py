"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, for every route.

Schema errors become 400 (not FastAPI's 422) naming the field; unknown routes 404; anything
unexpected 500 — always with the same body shape, so clients can parse every failure.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.errors import EngineDeadError, InvalidRequestError, RequestFailedError

logger = logging.getLogger("pagedllm")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}  # e.g. Retry-After on a 503


# An error message may quote what the client sent; keep it short.
MAX_MESSAGE_CHARS = 2000


def _safe_text(text: str, limit: int) -> str:
    """Text that encodes as UTF-8 (a lone surrogate quoted from the request would make the
    response itself fail), cut to `limit` characters."""
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None) -> dict:
    message = _safe_text(message, MAX_MESSAGE_CHARS)
    param = None if param is None else _safe_text(param, MAX_MESSAGE_CHARS)
    error_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def as_openai_error(error: Exception) -> OpenAIError:
    """Map an exception raised while serving a request to its HTTP status."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, InvalidRequestError):
        return OpenAIError(400, str(error), error.param)
    if isinstance(error, ValueError):
        return OpenAIError(400, str(error), _param_of(str(error)))
    if isinstance(error, EngineDeadError):
        return OpenAIError(500, f"the engine stopped: {error}")
    if isinstance(error, RequestFailedError):  # the core logged it; the engine goes on
        return OpenAIError(500, str(error))
    if isinstance(error, RecursionError):
        # The edge bounds nesting (protocol.MAX_REQUEST_DEPTH, validation.MAX_SCHEMA_DEPTH);
        # a recursion past them is still the input's depth, not the server's state.
        logger.warning("A request recursed too deeply", exc_info=error)
        return OpenAIError(400, "the request is nested too deeply to process")
    logger.exception("Unexpected error while serving a request", exc_info=error)
    return OpenAIError(500, f"internal error: {type(error).__name__}: {error}")


def _param_of(message: str) -> str | None:
    """SamplingParams' messages start with the field they are about ("top_p must be ...")."""
    head = message.split(" ", 1)[0].rstrip(":")
    dotted = all(part.isidentifier() for part in head.split("."))
    return head if dotted and head.islower() else None


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    details = error.errors()
    if not details:
        return "invalid request body", None
    first = details[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequestError):  # raised by a validator of ours: it names the field
        return str(cause), cause.param
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg')}", None
    param = ".".join(location) or None
    more = f" (and {len(details) - 1} more problem(s))" if len(details) > 1 else ""
    return f"{param or 'body'}: {first.get('msg')}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        # Keeps Starlette's headers: a 405 must say which methods are allowed (`Allow`).
        return error_response(error.status_code, str(error.detail), headers=error.headers)

    @app.exception_handler(OpenAIError)
    async def _on_openai(_: Request, error: OpenAIError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.headers)

    # Handlers for specific classes answer and keep the connection; Starlette's catch-all
    # (Exception) answers too, but then re-raises and the connection is dropped.
    @app.exception_handler(ValueError)
    async def _on_value(_: Request, error: ValueError) -> JSONResponse:
        mapped = as_openai_error(error)
        return error_response(mapped.status, mapped.message, mapped.param)

    @app.exception_handler(Exception)
    async def _on_other(_: Request, error: Exception) -> JSONResponse:
        mapped = as_openai_error(error)
        return error_response(mapped.status, mapped.message, mapped.param)
