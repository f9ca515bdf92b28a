"""HTTP request limits of every server: header deadline and size, body cap, body gap, deadline.

A server states its limits once, as :class:`HttpLimits`, and two layers enforce them:

* :func:`limited_http_protocol`, uvicorn's httptools protocol with a header deadline (a
  request's line and headers must be complete ``header_timeout`` seconds after its first
  byte, or after the connection opened for its first request; else 408 or a silent close)
  and a header size cap (431 and close). Idle kept-alive connections are closed by
  uvicorn's own ``timeout_keep_alive`` (:func:`uvicorn_settings` sets both). A request
  answered before its body arrived whole (an auth check's 401, say) ends its connection:
  uvicorn would drop the rest of the body as it came, unbounded, since each byte of it
  puts off the keep-alive timeout again.
* :class:`BodyLimitMiddleware`, ASGI middleware: a body over ``max_body_bytes`` gets 413
  (at once when ``Content-Length`` says so, else as soon as the streamed bytes pass the
  cap, so no body over the cap is ever buffered), a body that stalls ``body_timeout``
  seconds between two parts gets 408, and a request with no response ``request_deadline``
  seconds after it arrived gets 504 (the app's task is cancelled).

Each server answers in its own error shape (an :data:`ErrorShape` hook) and names what
changes each limit (its flag, by default). A refused connection is half-closed and drained
for a moment before it closes, so that a client still sending can read the 413 or 408.
:class:`LimitFlags` adds a server's limit flags to its command line and reads them back.

The limits and their refusals are in :mod:`.limits`, the protocol in :mod:`.protocol`, the
middleware in :mod:`.middleware` and the flags in :mod:`.flags`; every name is importable
from this package.
"""

from __future__ import annotations

from areal.utils.http_limits.flags import LimitFlags, limit_from_env
from areal.utils.http_limits.limits import (
    FLAG_OF,
    ErrorShape,
    Headers,
    HttpLimits,
    Refusal,
    Scope,
    json_error,
)
from areal.utils.http_limits.middleware import BodyLimitMiddleware, content_length, read_body
from areal.utils.http_limits.protocol import (
    HeaderTimeoutReply,
    LimitedHttpProtocol,
    limited_http_protocol,
    uvicorn_settings,
)
from areal.utils.http_limits.protocol import (  # tests read its linger time
    _LingeringTransport as _LingeringTransport,
)

__all__ = [
    "FLAG_OF",
    "BodyLimitMiddleware",
    "ErrorShape",
    "HeaderTimeoutReply",
    "Headers",
    "HttpLimits",
    "LimitFlags",
    "LimitedHttpProtocol",
    "Refusal",
    "Scope",
    "content_length",
    "json_error",
    "limit_from_env",
    "limited_http_protocol",
    "read_body",
    "uvicorn_settings",
]
