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
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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


def _full_headers(headers: Headers, body: bytes, close: bool) -> Headers:
    out = [*headers, (b"content-length", str(len(body)).encode())]
    return [*out, (b"connection", b"close")] if close else out


# --- refusals: one message per limit ---


def _body_too_large(limits: HttpLimits, size: int, declared: bool) -> Refusal:
    cap = limits.max_body_bytes
    what = f"{size} bytes" if declared else f"at least {size} bytes"
    message = f"the request body ({what}) is over the limit of {cap} bytes"
    return Refusal(413, "request_too_large", message + limits.hint("max_body_bytes"), cap)


def _body_stalled(limits: HttpLimits) -> Refusal:
    timeout = limits.body_timeout
    message = f"the request body did not arrive: no part of it for {timeout:g} s"
    return Refusal(408, "request_timeout", message + limits.hint("body_timeout"), timeout)


def _deadline_passed(limits: HttpLimits) -> Refusal:
    deadline = limits.request_deadline
    message = f"no response within the request deadline of {deadline:g} s"
    message += limits.hint("request_deadline")
    return Refusal(504, "request_deadline_exceeded", message, deadline)


def _headers_late(limits: HttpLimits) -> Refusal:
    timeout = limits.header_timeout
    message = f"the request headers did not arrive within {timeout:g} s"
    return Refusal(408, "request_timeout", message + limits.hint("header_timeout"), timeout)


def _headers_too_large(limits: HttpLimits, status: int) -> Refusal:
    cap = limits.max_header_bytes
    message = f"the request line and headers are over {cap} bytes"
    message += limits.hint("max_header_bytes")
    return Refusal(status, "request_headers_too_large", message, cap)  # status: 431, or 400


# --- the HTTP protocol: header deadline, header size, lingering close ---

HeaderTimeoutReply = Literal["always", "after_first_byte", "never"]
"""What a connection whose headers are late gets: 408 then close (``always``); 408 only if
the request's first byte arrived, else a silent close (``after_first_byte``); a silent
close (``never``)."""


@dataclass(frozen=True)
class _ProtocolSettings:
    limits: HttpLimits
    error_shape: ErrorShape
    header_timeout_reply: HeaderTimeoutReply
    header_limit_status: int


class _HeadersTooLargeError(Exception):
    """Stops the parser once the headers pass the cap."""


class _LingeringTransport:
    """A transport whose ``close`` lingers while the client may still be sending.

    Closing a socket with unread request bytes makes the kernel answer with a reset, and
    the client may then lose the response it has not read yet (a 413 for a body over the
    cap, above all). So while the request is unfinished, ``close`` half-closes instead
    (the response and a FIN go out), drops what still arrives for ``LINGER_S`` seconds or
    until the client closes, and only then closes.
    """

    LINGER_S = 2.0

    def __init__(self, transport: asyncio.Transport, protocol: LimitedHttpProtocol):
        self._transport = transport
        self._protocol = protocol
        self._lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._lingering or self._transport.is_closing()

    def close(self) -> None:
        transport = self._transport
        if (
            self._lingering
            or not self._protocol.client_may_be_sending()
            or transport.is_closing()
            or not transport.can_write_eof()
        ):
            transport.close()
            return
        self._lingering = True
        transport.write_eof()
        transport.resume_reading()  # what arrives now is dropped (see data_received)
        self._protocol.loop.call_later(self.LINGER_S, transport.close)


class LimitedHttpProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` with a per-request header deadline and size cap, that
    closes a connection whose request was answered before its body arrived whole.

    Use :func:`limited_http_protocol`, which makes a subclass with a server's settings.
    """

    settings = _ProtocolSettings(HttpLimits(), json_error, "always", 431)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_headers = False  # between a request's first byte and the end of its headers
        self._header_bytes = 0  # the request line and the headers parsed so far
        self._open_header_bytes = 0  # chunks that left a header unfinished (not parsed yet)
        self._refusal: Refusal | None = None

    def client_may_be_sending(self) -> bool:
        """Whether the current request's headers or body may still be on their way."""
        return self._in_headers or (self.cycle is not None and self.cycle.more_body)

    # --- the connection ---

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return  # refused or lingering: what the client still sends is dropped
        super().data_received(data)
        cap = self.settings.limits.max_header_bytes
        if self._in_headers and cap is not None:
            self._open_header_bytes += len(data)
            if self._open_header_bytes > cap:
                self._refuse(self._headers_too_large())

    def _close_if_answered_early(self, cycle: Any) -> None:
        """Make ``cycle`` end its connection if its answer starts before its body arrived.

        uvicorn would drop the rest of the body as it arrives, and each byte cancels the
        keep-alive timeout, so a trickle (or one byte, then silence) would hold the
        connection forever. The answer says ``connection: close`` instead (so no client
        sends another request on it) and the connection closes after it, lingering so the
        client reads the answer. Decided at the answer's start, never after it went out
        as a keep-alive answer: a client could already be reusing the connection.
        """
        send = cycle.send

        async def send_closing(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and cycle.more_body:
                cycle.keep_alive = False  # uvicorn adds the header and closes after the body
            await send(message)

        cycle.send = send_closing  # run_asgi hands the app cycle.send, looked up at its start

    def _refuse(self, refusal: Refusal) -> None:
        self._disarm_header_timer()
        if self.transport.is_closing():
            return
        headers, body = self.settings.error_shape(refusal, None)
        status = f"HTTP/1.1 {refusal.status} {HTTPStatus(refusal.status).phrase}\r\n".encode()
        lines = [b"%s: %s\r\n" % pair for pair in _full_headers(headers, body, close=True)]
        self.transport.write(status + b"".join(lines) + b"\r\n" + body)
        self.transport.close()

    # --- the header deadline ---

    def _arm_header_timer(self) -> None:
        timeout = self.settings.limits.header_timeout
        if self._header_timer is None and timeout is not None:
            self._header_timer = self.loop.call_later(timeout, self._on_headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a pipelined request stalls: close after this one
            return
        reply = self.settings.header_timeout_reply
        if reply == "always" or (reply == "after_first_byte" and self._in_headers):
            self._refuse(_headers_late(self.settings.limits))
        else:
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._header_bytes = self._open_header_bytes = 0
        self._arm_header_timer()  # a no-op for the first request: its clock started on connect

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm_header_timer()
        super().on_headers_complete()
        if self.cycle is not None:
            self._close_if_answered_early(self.cycle)

    # --- the header size cap ---

    def _count_header_bytes(self, size: int) -> None:
        cap = self.settings.limits.max_header_bytes
        self._header_bytes += size
        if cap is not None and self._header_bytes > cap:
            self._refusal = self._headers_too_large()
            raise _HeadersTooLargeError()

    def _headers_too_large(self) -> Refusal:
        return _headers_too_large(self.settings.limits, self.settings.header_limit_status)

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        if self._refusal is None:
            super().send_400_response(msg)  # a malformed request, as uvicorn answers it
        else:
            self._refuse(self._refusal)  # raised by _count_header_bytes inside the parser


def limited_http_protocol(
    limits: HttpLimits,
    *,
    error_shape: ErrorShape = json_error,
    header_timeout_reply: HeaderTimeoutReply = "always",
    header_limit_status: int = 431,
) -> type[LimitedHttpProtocol]:
    """The protocol class to pass as uvicorn's ``http``, with the header limits of ``limits``.

    ``header_limit_status`` is the status of headers over the cap (431; the RPC servers
    answer 400, as they always have).
    """
    settings = _ProtocolSettings(limits, error_shape, header_timeout_reply, header_limit_status)
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"settings": settings})


def uvicorn_settings(limits: HttpLimits, **protocol: Any) -> dict[str, Any]:
    """uvicorn settings (``http``, ``timeout_keep_alive``) for ``limits``; ``protocol``
    goes to :func:`limited_http_protocol`."""
    return {
        "http": limited_http_protocol(limits, **protocol),
        "timeout_keep_alive": limits.keep_alive_timeout,
    }


# --- the ASGI middleware: body cap, body gap, request deadline ---


def content_length(scope: Scope) -> int | None:
    """The ``Content-Length`` a request declares (None when absent or not a number)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            value = value.strip()
            return int(value) if value.isdigit() else None
    return None


async def read_body(receive: Any) -> bytes | None:
    """A request's whole body; None when the client went away (or the limits refused it)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_refusal(
    send: Any, shape: ErrorShape, refusal: Refusal, scope: Scope, close: bool
) -> None:
    headers, body = shape(refusal, scope)
    start = {"status": refusal.status, "headers": _full_headers(headers, body, close)}
    await send({"type": "http.response.start", **start})
    await send({"type": "http.response.body", "body": body})


class _Exchange:
    """One request's response as the middleware sees it."""

    def __init__(self, send: Any):
        self._send = send
        self.started = False  # a response start went out (the app's or a refusal)
        self.answered = False  # refused: what the app still sends is dropped

    async def send(self, message: dict[str, Any]) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    async def refuse(
        self, shape: ErrorShape, refusal: Refusal, scope: Scope, close: bool = True
    ) -> None:
        if not self.started:
            self.started = True
            await _send_refusal(self._send, shape, refusal, scope, close)
        self.answered = True


class BodyLimitMiddleware:
    """ASGI middleware for the body cap, the body timeout and the request deadline.

    A refused request is answered at once; the app then reads ``http.disconnect``, and
    whatever it makes of that (an error, another answer) is dropped.
    """

    def __init__(self, app: Any, limits: HttpLimits, error_shape: ErrorShape = json_error):
        self.app = app
        self.limits = limits
        self.error_shape = error_shape

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits, shape = self.limits, self.error_shape
        cap = limits.max_body_bytes
        declared = content_length(scope)
        if cap is not None and declared is not None and declared > cap:
            await _send_refusal(send, shape, _body_too_large(limits, declared, True), scope, True)
            return
        exchange = _Exchange(send)
        received = 0
        body_done = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal received, body_done
            if body_done or exchange.answered:
                return await receive()
            try:
                async with asyncio.timeout(limits.body_timeout):
                    message = await receive()
            except TimeoutError:
                await exchange.refuse(shape, _body_stalled(limits), scope)
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if cap is not None and received > cap:
                    await exchange.refuse(shape, _body_too_large(limits, received, False), scope)
                    return {"type": "http.disconnect"}
                body_done = not message.get("more_body", False)
            return message

        deadline = limits.request_deadline
        try:
            async with asyncio.timeout(deadline) as timer:
                await self.app(scope, limited_receive, exchange.send)
        except TimeoutError:
            if deadline is None or not timer.expired():
                raise
            # the request itself was fine: its connection stays open, unlike after a 413
            # or 408 (unless its body is still arriving: see LimitedHttpProtocol)
            await exchange.refuse(shape, _deadline_passed(limits), scope, close=False)
        except Exception:
            if not exchange.answered:
                raise  # the app failed on its own: let the server's 500 handling see it


# --- command-line flags ---


@dataclass(frozen=True)
class _Flag:
    field: str
    type: type
    help: str
    zero_disables: bool = False


_FLAGS = {
    "--max-body-bytes": _Flag("max_body_bytes", int, "largest request body in bytes; 413 above"),
    "--body-timeout": _Flag(
        "body_timeout", float, "seconds a request body may stall between two parts; 408 after"
    ),
    "--header-timeout": _Flag(
        "header_timeout", float, "seconds a request's line and headers may take to arrive"
    ),
    "--max-header-bytes": _Flag(
        "max_header_bytes", int, "largest request line plus headers in bytes; 431 above"
    ),
    "--idle-timeout": _Flag(
        "keep_alive_timeout", int, "seconds a kept-alive connection may idle between requests"
    ),
    "--keep-alive-timeout": _Flag(
        "keep_alive_timeout", float, "seconds an idle kept-alive connection stays open"
    ),
    "--request-deadline": _Flag(
        "request_deadline",
        float,
        "seconds until an unanswered request gets 504 and is cancelled; 0 disables",
        zero_disables=True,
    ),
}


def limit_from_env(name: str, default: Any, kind: type = float) -> Any:
    """A positive number from ``$name``, else ``default``; a clear error if malformed."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"${name}={raw!r} is not {what}") from None
    if not value > 0:
        raise ValueError(f"${name} must be positive (got {raw!r})")
    return value


@dataclass(frozen=True)
class LimitFlags:
    """The limit flags of one server's command line, with that server's defaults.

    ``flags`` are spelled as on the command line (see ``_FLAGS``); ``env`` maps a flag to
    the environment variable that gives its default.
    """

    defaults: HttpLimits
    flags: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [flag for flag in self.flags if flag not in _FLAGS]
        if unknown:
            raise ValueError(f"no such limit flags: {unknown} (known: {sorted(_FLAGS)})")

    def add_arguments(
        self, parser: argparse.ArgumentParser, description: str | None = None
    ) -> argparse._ArgumentGroup:
        """Add the flags to ``parser`` in a ``limits`` group (returned, for more flags)."""
        group = parser.add_argument_group("limits", description)
        for flag in self.flags:
            spec = _FLAGS[flag]
            default = getattr(self.defaults, spec.field)
            if spec.zero_disables and default is None:
                default = 0
            if flag in self.env:  # None here: parse() reads the variable, then the default
                shown, default = f"${self.env[flag]}, else {default}", None
            else:
                shown = "%(default)s"
            group.add_argument(
                flag, type=spec.type, default=default, help=f"{spec.help} (default {shown})"
            )
        return group

    def parse(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> HttpLimits:
        """The limits ``args`` give; ``parser.error`` naming the flag for a bad value."""
        values: dict[str, Any] = {}
        for flag in self.flags:
            spec = _FLAGS[flag]
            value = getattr(args, flag[2:].replace("-", "_"))
            if value is None and flag in self.env:
                try:
                    value = limit_from_env(
                        self.env[flag], getattr(self.defaults, spec.field), spec.type
                    )
                except ValueError as e:
                    parser.error(str(e))
            if spec.zero_disables and value == 0:
                value = None
            elif not (math.isfinite(value) and value > 0):
                zero = " (or 0 for none)" if spec.zero_disables else ""
                parser.error(f"{flag} must be positive{zero}, got {value}")
            values[spec.field] = value
        return dataclasses.replace(self.defaults, **values)
