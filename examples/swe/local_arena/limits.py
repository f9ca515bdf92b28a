"""HTTP limits of the local Arena: a request-body cap (413) and a request-header deadline.

:class:`BodySizeLimit` is ASGI middleware: a declared ``Content-Length`` over the limit is
answered 413 before anything is read, and a chunked body is counted as it arrives and
refused the moment it passes the limit: the read raises :class:`BodyTooLargeError` inside
the app, and whatever the app makes of that, the client gets the 413.

:func:`header_deadline_protocol` makes a uvicorn HTTP protocol class that closes a
connection whose request headers are not complete within a deadline of the request's
first byte (or of the connection, for its first request): uvicorn's keep-alive timeout
covers idle connections only, so without it a client that sends half a request line holds
its connection, and a slot of the server, forever.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodySizeLimit", "BodyTooLargeError", "header_deadline_protocol"]


class BodyTooLargeError(Exception):
    """A request body passed the limit while it was being read."""

    def __init__(self, limit: int):
        super().__init__(f"the request body exceeds the local Arena's limit of {limit} bytes")
        self.limit = limit


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over ``limit`` bytes (see the module)."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def _refuse(self, send: Send) -> None:
        body = orjson.dumps(
            {"error": {"code": "body_too_large", "message": str(BodyTooLargeError(self.limit))}}
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(send)
                return
        received, too_large, started = 0, False, False

        async def counted() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    too_large = True
                    raise BodyTooLargeError(self.limit)
            return message

        async def forward(message: Message) -> None:
            nonlocal started
            if too_large:
                return  # whatever the app answers to the aborted read, the 413 goes out
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, forward)
        except Exception:  # the error may come wrapped by middleware (an ExceptionGroup)
            if not too_large:
                raise
        if too_large and not started:
            await self._refuse(send)


class _HeaderDeadline:
    """Mixin for a uvicorn HTTP protocol (h11 or httptools); see the module docstring.

    Both protocols replace ``self.cycle`` when a request's headers are complete, and mark
    it ``response_complete`` when its response is sent: between the two, a request is in
    flight; otherwise the connection waits for headers and the deadline applies.
    """

    header_timeout: float = 10.0
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_cycle: Any = None
        self._arm()

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline_cycle = self.cycle
        self._deadline = self.loop.call_later(self.header_timeout, self._headers_overdue)

    def data_received(self, data: bytes) -> None:
        # The first byte of a new request starts its deadline (keep-alive ends there).
        if self._waiting_for_headers() and (
            self._deadline is None or self._deadline_cycle is not self.cycle
        ):
            self._arm()
        super().data_received(data)  # type: ignore[misc]

    def _headers_overdue(self) -> None:
        self._deadline = None
        started = self.cycle is not self._deadline_cycle
        if not started and self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)  # type: ignore[misc]


def header_deadline_protocol(timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools when installed, else h11) with a deadline
    of ``timeout`` seconds for each request's headers; pass it as ``uvicorn.Config(http=)``."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base
    return type(
        f"HeaderDeadline{Base.__name__}", (_HeaderDeadline, Base), {"header_timeout": timeout}
    )
