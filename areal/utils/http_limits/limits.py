"""What a server's HTTP limits are, the refusal each one answers with, and its error shape."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = [
    "FLAG_OF",
    "ErrorShape",
    "Headers",
    "HttpLimits",
    "Refusal",
    "Scope",
    "full_headers",
    "json_error",
]

Scope = dict[str, Any]
Headers = list[tuple[bytes, bytes]]

FLAG_OF = {
    "max_body_bytes": "--max-body-bytes",
    "body_timeout": "--body-timeout",
    "request_deadline": "--request-deadline",
    "header_timeout": "--header-timeout",
    "max_header_bytes": "--max-header-bytes",
}
"""The flag that sets each limit on every server's command line, named in its errors."""


@dataclass(frozen=True)
class HttpLimits:
    """One server's limits; sizes in bytes, times in seconds, ``None`` for no limit."""

    max_body_bytes: int | None = None
    """Largest request body (413 above), checked against ``Content-Length`` and while read."""
    body_timeout: float | None = None
    """Longest silence between two parts of a request body (408)."""
    request_deadline: float | None = None
    """A request still unanswered this long after its headers gets 504."""
    header_timeout: float | None = None
    """A request's line and headers must be complete this long after its first byte."""
    max_header_bytes: int | None = None
    """Largest request line plus headers (431 above)."""
    keep_alive_timeout: float = 5.0
    """An idle kept-alive connection closes after this (uvicorn's ``timeout_keep_alive``)."""
    changed_by: Mapping[str, str | None] = field(default_factory=dict)
    """What changes a limit, named in its errors (default: its flag in :data:`FLAG_OF`;
    ``None``: nothing to name)."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_header_bytes"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{_described(name)} must be at least 1 byte, got {value!r}")
        for name in ("body_timeout", "request_deadline", "header_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{_described(name)} must be positive seconds, got {value!r}")

    def hint(self, name: str) -> str:
        """`` (what changes it)`` for the limit ``name``, or nothing."""
        what = self.changed_by.get(name, FLAG_OF.get(name))
        return f" ({what})" if what else ""


def _described(name: str) -> str:
    return f"{name} ({FLAG_OF[name]})" if name in FLAG_OF else name


@dataclass(frozen=True)
class Refusal:
    """A request refused for passing one of the limits."""

    status: int
    kind: str
    """``request_too_large``, ``request_timeout``, ``request_headers_too_large`` or
    ``request_deadline_exceeded``."""
    message: str
    """What was refused and what changes the limit."""
    limit: float
    """The limit passed, in its unit (bytes or seconds)."""


ErrorShape = Callable[[Refusal, Scope | None], tuple[Headers, bytes]]
"""A server's error body: ``(refusal, scope) -> (headers, body)``; ``scope`` is ``None``
when the request was refused before its headers were complete. ``content-length`` and
``connection`` are added by the caller."""


def json_error(refusal: Refusal, scope: Scope | None) -> tuple[Headers, bytes]:
    """The default shape: ``{"error": {"message", "type"}}``."""
    body = orjson.dumps({"error": {"message": refusal.message, "type": refusal.kind}})
    return [(b"content-type", b"application/json")], body


def full_headers(headers: Headers, body: bytes, close: bool) -> Headers:
    out = [*headers, (b"content-length", str(len(body)).encode())]
    return [*out, (b"connection", b"close")] if close else out
