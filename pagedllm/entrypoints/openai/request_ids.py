"""What a client-chosen request id may be: it is echoed in the `X-Request-Id` response
header, logged and used as the engine's request id, so it is short, visible ASCII, and
without "#" (`core.request.CHILD_SEPARATOR`): the engine names the samples it forks for
n > 1 `<id>#<i>`, and a client id equal to one of those would collide with it in the
engine core.

Checked for the `request_id` body field (`protocol.py`) and the `X-Request-Id` request
header (`app.GuardMiddleware`) alike.

Ids are scoped per tenant: the engine knows a tenant's request as `<tenant>:<id>`
(`engine_request_id`), so two tenants may use the same id at once, a duplicate in-flight id
is refused only within one tenant, and one tenant cannot learn or block another's ids. The
scoped id stays inside the server: clients are answered with the id they sent
(`client_error`).
"""

from __future__ import annotations

import re
import uuid

from pagedllm.core.request import CHILD_SEPARATOR
from pagedllm.errors import InvalidRequestError, RequestFailedError

MAX_REQUEST_ID_CHARS = 256
# Tenant names are letters, digits, ".", "_" and "-" (`tenants._NAME`), never ":", so the first
# ":" of an engine id ends its tenant: "a:b-c" and "a-b:c" cannot be the same pair.
TENANT_SEPARATOR = ":"
# Visible ASCII (no spaces, no control characters: nothing a header or a log line could
# be split or spoofed with); CHILD_SEPARATOR is refused too (see above).
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")


def check_request_id(value: object, param: str) -> str:
    """`value` if it is a valid request id; InvalidRequestError naming `param` otherwise."""
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param}: must be a non-empty string", param)
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            f"{param}: {len(value)} characters; at most {MAX_REQUEST_ID_CHARS} are accepted",
            param,
        )
    if _REQUEST_ID.fullmatch(value) is None or CHILD_SEPARATOR in value:
        raise InvalidRequestError(
            f"{param}: only visible ASCII characters other than {CHILD_SEPARATOR!r} (no spaces "
            "or control characters) are accepted",
            param,
        )
    return value


def request_id_from_header(value: str | None) -> tuple[str, InvalidRequestError | None]:
    """(the id to answer with, the error to answer if the header's id is refused): a fresh
    id when the header is absent or refused, so nothing refused is ever echoed."""
    if not value:
        return uuid.uuid4().hex, None
    try:
        return check_request_id(value, "X-Request-Id"), None
    except InvalidRequestError as error:
        return uuid.uuid4().hex, error


def engine_request_id(tenant: str | None, request_id: str) -> str:
    """The id the engine runs a client's request under: scoped to its tenant (None: a server
    without API keys, where every request is one tenant's and the id is used as sent)."""
    return request_id if tenant is None else f"{tenant}{TENANT_SEPARATOR}{request_id}"


def client_error(error: Exception, engine_id: str, request_id: str) -> Exception:
    """`error` as the client may see it: an engine error that names the scoped `engine_id`
    (an id already running, a request that failed in the engine) names the client's
    `request_id` instead, so the tenant prefix is never shown back; others unchanged."""
    if engine_id == request_id:
        return error
    if isinstance(error, RequestFailedError):
        client_id = error.request_id.replace(engine_id, request_id, 1)
        return RequestFailedError(client_id, error.message)
    if isinstance(error, InvalidRequestError) and engine_id in str(error):
        return InvalidRequestError(str(error).replace(engine_id, request_id), error.param)
    return error
