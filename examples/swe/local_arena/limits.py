"""The local Arena's request limits: a body cap (413), a body gap (408), a header deadline.

A body over ``--max-body-bytes`` is answered 413 before it is read whole, whether it
declares a ``Content-Length`` or is chunked; one that stalls ``--body-timeout`` seconds
between two parts while it is read gets 408; and one answered before it arrived whole
(a 401 or 403 of the token check, an injected error) ends its connection after the
answer, so a client trickling a body cannot hold a connection either way. A connection
whose request headers are not complete ``--header-timeout`` seconds after the request's
first byte (or after it opened) is closed without an answer: uvicorn's keep-alive timeout
covers idle connections only, so without it a client that sends half a request line holds
a slot of the server forever. All are enforced by :mod:`areal.utils.http_limits`.
"""

from __future__ import annotations

from typing import Any

import orjson

from areal.utils.http_limits import (
    Headers,
    HttpLimits,
    LimitFlags,
    Refusal,
    Scope,
    uvicorn_settings,
)

__all__ = ["LIMITS", "LIMIT_FLAGS", "limit_error", "uvicorn_options"]

LIMITS = HttpLimits(
    max_body_bytes=16 * 1024 * 1024,  # harness calls carry whole conversations
    body_timeout=60.0,  # seconds of silence allowed between two parts of a body
    header_timeout=10.0,
)
"""The local Arena's request limits by default (its flags change them)."""
LIMIT_FLAGS = LimitFlags(LIMITS, ("--max-body-bytes", "--body-timeout", "--header-timeout"))


def limit_error(refusal: Refusal, scope: Scope | None) -> tuple[Headers, bytes]:
    """A refusal by the request limits, in the Arena's error shape (413: ``body_too_large``)."""
    code = "body_too_large" if refusal.status == 413 else refusal.kind
    body = orjson.dumps({"error": {"code": code, "message": refusal.message}})
    return [(b"content-type", b"application/json")], body


def uvicorn_options(limits: HttpLimits = LIMITS) -> dict[str, Any]:
    """uvicorn settings of the local Arena: its HTTP protocol, with the header deadline and
    the close of a connection whose request was answered before its body arrived."""
    return uvicorn_settings(limits, error_shape=limit_error, header_timeout_reply="never")
