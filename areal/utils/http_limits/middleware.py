"""ASGI middleware for a request's body cap, body gap and deadline, and body reading helpers."""

from __future__ import annotations

import asyncio
from typing import Any

from areal.utils.http_limits.limits import (
    ErrorShape,
    HttpLimits,
    Refusal,
    Scope,
    full_headers,
    json_error,
)

__all__ = ["BodyLimitMiddleware", "content_length", "read_body"]


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
    start = {"status": refusal.status, "headers": full_headers(headers, body, close)}
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
