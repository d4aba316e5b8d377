"""What a client-chosen request id may be: it is echoed in the `X-Request-Id` response
header, logged and used as the engine's request id, so it is short, visible ASCII, and
without "#" (`core.request.CHILD_SEPARATOR`): the engine names the samples it forks for
n > 1 `<id>#<i>`, and a client id equal to one of those would collide with it in the
engine core.

Checked for the `request_id` body field (`protocol.py`) and the `X-Request-Id` request
header (`app.GuardMiddleware`) alike.
"""

from __future__ import annotations

import re
import uuid

from pagedllm.core.request import CHILD_SEPARATOR
from pagedllm.errors import InvalidRequestError

MAX_REQUEST_ID_CHARS = 256
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
