"""uvicorn's httptools protocol with a header deadline, a header size cap and a lingering close.

A request's line and headers must be complete ``header_timeout`` seconds after its first
byte (or after the connection opened, for its first request), else 408 or a silent close;
headers over ``max_header_bytes`` get 431 and a close. A request answered before its body
arrived whole ends its connection, and a refused connection is half-closed and drained
for a moment before it closes, so that a client still sending can read the answer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from areal.utils.http_limits.limits import (
    ErrorShape,
    HttpLimits,
    Refusal,
    full_headers,
    json_error,
)

__all__ = [
    "HeaderTimeoutReply",
    "LimitedHttpProtocol",
    "limited_http_protocol",
    "uvicorn_settings",
]


def _headers_late(limits: HttpLimits) -> Refusal:
    timeout = limits.header_timeout
    message = f"the request headers did not arrive within {timeout:g} s"
    return Refusal(408, "request_timeout", message + limits.hint("header_timeout"), timeout)


def _headers_too_large(limits: HttpLimits, status: int) -> Refusal:
    cap = limits.max_header_bytes
    message = f"the request line and headers are over {cap} bytes"
    message += limits.hint("max_header_bytes")
    return Refusal(status, "request_headers_too_large", message, cap)  # status: 431, or 400


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
        lines = [b"%s: %s\r\n" % pair for pair in full_headers(headers, body, close=True)]
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
