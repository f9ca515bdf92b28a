"""Transport limits of the embedded inference server: sizes, read timeouts, deadlines.

Two layers enforce :class:`ServerLimits`:

* :func:`guarded_http_protocol`, uvicorn's httptools protocol with a header deadline
  (the next request's line and headers must arrive within ``header_timeout`` of the
  connection opening or of the previous response: else 408 and close, or a silent close
  of a connection that sent nothing) and a header size cap (431 and close); idle
  keep-alive connections close after ``keep_alive_timeout`` (uvicorn's own timer).
* :class:`LimitsMiddleware`, an ASGI middleware: bodies over ``max_body_bytes`` get 413
  (at once when ``Content-Length`` says so, else as soon as the streamed bytes pass the
  cap, so an oversized body is never buffered), a body that has not fully arrived within
  ``body_timeout`` gets 408, and a request with no response after ``request_deadline``
  gets 504 (its generation is cancelled, which frees its batch slot).

Bodies are read in chunks as they arrive, so a slow or large upload never holds the event
loop; decoding a body costs the loop about 12 ms per MiB, which the size cap bounds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from areal.inference.auth import send_json_error

__all__ = ["LimitsMiddleware", "ServerLimits", "guarded_http_protocol"]

_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s"
)
_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
    b"charset=utf-8\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
)


@dataclass(frozen=True)
class ServerLimits:
    """Limits on one request; sizes in bytes, times in seconds (0 disables a deadline)."""

    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body (413 above). 4 MiB holds a prompt of ~500k token ids."""
    max_header_bytes: int = 64 * 1024
    """Largest request line plus headers (431 above)."""
    header_timeout: float = 10.0
    """Request line and headers must arrive within this (408 and close)."""
    body_timeout: float = 60.0
    """The whole body must arrive within this after the headers (408)."""
    keep_alive_timeout: float = 5.0
    """An idle keep-alive connection is closed after this (SGLang's default)."""
    request_deadline: float = 3600.0
    """A request still unanswered after this gets 504 and its generation is cancelled."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.request_deadline < 0:
            raise ValueError(f"request_deadline must be >= 0, got {self.request_deadline}")


class _Exchange:
    """One request's response state as the middleware sees it."""

    def __init__(self, send: Any):
        self._send = send
        self.started = False  # a response start went out (ours or the app's)
        self.answered = False  # the middleware answered; later app messages are dropped

    async def send(self, message: dict[str, Any]) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    async def answer(self, status: int, message: str) -> None:
        if not self.started:
            self.started = True
            await send_json_error(self._send, status, message, "invalid_request_error")
        self.answered = True


class LimitsMiddleware:
    """ASGI middleware for the body cap, the body timeout and the request deadline."""

    def __init__(self, app: Any, limits: ServerLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.limits
        declared = _content_length(scope)
        if declared is not None and declared > limits.max_body_bytes:
            await send_json_error(send, 413, _too_large(declared, limits), "invalid_request_error")
            return
        exchange = _Exchange(send)
        loop = asyncio.get_running_loop()
        body_deadline = loop.time() + limits.body_timeout
        received = 0
        body_done = False

        async def guarded_receive() -> dict[str, Any]:
            nonlocal received, body_done
            if body_done or exchange.answered:
                return await receive()
            try:
                async with asyncio.timeout_at(body_deadline):
                    message = await receive()
            except TimeoutError:
                await exchange.answer(
                    408, f"the request body did not arrive within {limits.body_timeout:g} s"
                )
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limits.max_body_bytes:
                    await exchange.answer(413, _too_large(received, limits))
                    return {"type": "http.disconnect"}
                body_done = not message.get("more_body", False)
            return message

        try:
            if limits.request_deadline:
                async with asyncio.timeout(limits.request_deadline) as deadline:
                    await self.app(scope, guarded_receive, exchange.send)
            else:
                await self.app(scope, guarded_receive, exchange.send)
        except TimeoutError:
            if not (limits.request_deadline and deadline.expired()):
                raise
            await exchange.answer(
                504, f"no response within the request deadline of {limits.request_deadline:g} s"
            )
        except Exception:
            if not exchange.answered:
                raise  # the app failed on its own: let the server's 500 handling see it


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large(size: int, limits: ServerLimits) -> str:
    return (
        f"the request body ({size} bytes or more) is larger than this server's limit of "
        f"{limits.max_body_bytes} bytes (--max-body-bytes)"
    )


def guarded_http_protocol(limits: ServerLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the header deadline and size cap of ``limits``."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _in_headers = False  # between a message's first byte and the end of its headers
        _header_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_headers:  # counts whole chunks: the cap is exact to one read
                self._header_bytes += len(data)
                if self._header_bytes > limits.max_header_bytes:
                    self._refuse(_431, b"request headers too large")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers = True
            self._header_bytes = 0

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._stop_header_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # the next request's headers are due, unless a pipelined one is being served
            if not self.transport.is_closing() and self.cycle.response_complete:
                self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._stop_header_timer()
            self._header_timer = self.loop.call_later(limits.header_timeout, self._on_timeout)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_timeout(self) -> None:
            self._header_timer = None
            if self._in_headers:
                self._refuse(_408, b"request headers took too long")
            elif not self.transport.is_closing():
                self.transport.close()  # idle, or still sending a body already answered

        def _refuse(self, template: bytes, reason: bytes) -> None:
            self._in_headers = False
            self._stop_header_timer()
            if not self.transport.is_closing():
                self.transport.write(template % (len(reason), reason))
                self.transport.close()

    return GuardedHttpToolsProtocol
