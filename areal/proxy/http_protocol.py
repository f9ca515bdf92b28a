"""uvicorn's httptools protocol with a header deadline and a header size cap.

uvicorn bounds the idle time between requests on a kept-alive connection
(``timeout_keep_alive``) but not the time a client may take to send a request's headers,
nor their size: a client that connects and trickles header bytes holds a connection (and
its buffered headers) forever. This protocol answers 408 and closes when a request's
headers are not complete ``header_timeout`` seconds after the connection opened or the
request's first byte arrived, and 431 when the request line and headers pass
``max_header_bytes``. A connection closed while its client is still sending a body (after
a 413) lingers briefly, so that the client can read the answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = [
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_MAX_HEADER_BYTES",
    "GuardedHttpToolsProtocol",
    "guarded_http_protocol",
]

DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _HeadersTooLargeError(Exception):
    """Stops the parser once the headers pass the cap."""


def _closing_response(status: int, message: str, kind: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": kind}})
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body))
    )
    return head + body


class _LingeringTransport:
    """A transport whose ``close`` lingers while the client is still sending a body.

    Closing a socket with unread request bytes makes the kernel answer with a reset, and
    the client may then lose the response it has not read yet (a 413 for a body over the
    cap, above all). So when the body is unfinished, ``close`` half-closes instead (the
    response and a FIN go out), keeps reading and discarding for ``LINGER_S`` seconds or
    until the client closes, and only then closes.
    """

    LINGER_S = 2.0

    def __init__(self, transport: asyncio.Transport, protocol: GuardedHttpToolsProtocol):
        self._transport = transport
        self._protocol = protocol
        self._lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._lingering or self._transport.is_closing()

    def close(self) -> None:
        cycle = self._protocol.cycle
        unfinished = cycle is not None and cycle.more_body
        transport = self._transport
        if (
            self._lingering
            or not unfinished
            or transport.is_closing()
            or not transport.can_write_eof()
        ):
            transport.close()
            return
        self._lingering = True
        transport.write_eof()
        transport.resume_reading()  # what arrives now is parsed and dropped
        self._protocol.loop.call_later(self.LINGER_S, transport.close)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` with a per-request header deadline and size cap."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._refusal: bytes | None = None

    # --- the header deadline ---

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and self.header_timeout > 0:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a pipelined request stalls: close after this one
            return
        message = (
            f"the request headers did not arrive within {self.header_timeout:g} s "
            "(--header-timeout)"
        )
        self.transport.write(_closing_response(408, message, "request_timeout"))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._arm_header_timer()  # a no-op for the first request: its clock started on connect

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    # --- the header size cap ---

    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.max_header_bytes:
            message = (
                f"the request line and headers are over {self.max_header_bytes} bytes "
                "(--max-header-bytes)"
            )
            self._refusal = _closing_response(431, message, "request_headers_too_large")
            raise _HeadersTooLargeError()

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        if self._refusal is None:
            super().send_400_response(msg)
            return
        self._disarm_header_timer()
        self.transport.write(self._refusal)
        self.transport.close()


def guarded_http_protocol(
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class to pass as uvicorn's ``http``, with these limits."""
    return type(
        "GuardedHttpToolsProtocol",
        (GuardedHttpToolsProtocol,),
        {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes},
    )
