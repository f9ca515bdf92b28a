"""The proxy's HTTP layer: exact-path routing and JSON/SSE responses on bare ASGI.

Every proxy endpoint takes a JSON body and answers JSON or server-sent events, and each
handler maps its own errors to statuses, so a framework's routing, middleware and
request objects would only add per-request cost on the hot path. :class:`App` routes by
exact path and method (404 and 405 answered as JSON), runs a lifespan context, and hands
handlers a :class:`Request` with lower-cased headers and the body.

Bodies are capped (``max_body_bytes``): a declared ``Content-Length`` over the cap is
refused with 413 before any of the body is read, and a body without one is refused as
soon as what arrived passes the cap, so no request can make the proxy hold more than the
cap in memory. A body that stops arriving for ``body_timeout`` seconds gets 408.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import orjson

__all__ = [
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "App",
    "BodyTimeoutError",
    "BodyTooLargeError",
    "ClientDisconnectedError",
    "Request",
    "Response",
    "StreamingResponse",
]

JSON = b"application/json"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 60.0
CLOSE = (b"connection", b"close")


class ClientDisconnectedError(Exception):
    """The client went away before its request body arrived."""


class BodyTooLargeError(Exception):
    """A request body over the cap (HTTP 413); ``limit`` is the cap in bytes."""

    def __init__(self, limit: int, declared: int | None = None):
        size = f"{declared} bytes" if declared is not None else "more than that"
        super().__init__(f"the request body ({size}) is over the limit of {limit} bytes")
        self.limit, self.declared = limit, declared


class BodyTimeoutError(Exception):
    """No part of the request body arrived for ``timeout`` seconds (HTTP 408)."""

    def __init__(self, timeout: float):
        super().__init__(f"the request body stalled for {timeout:g} s")
        self.timeout = timeout


def declared_length(headers: dict[str, str]) -> int | None:
    """The ``Content-Length`` a request declares (None when absent or not a number)."""
    value = headers.get("content-length")
    if value is None or not value.strip().isdigit():
        return None
    return int(value)


class Request:
    """Headers (names lower-cased; the first of repeated names wins) and the body."""

    __slots__ = ("_receive", "body_timeout", "headers", "max_body_bytes", "method", "path")

    def __init__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict]],
        max_body_bytes: int | None = None,
        body_timeout: float | None = None,
    ):
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1").lower()
            if key not in headers:
                headers[key] = value.decode("latin-1")
        self.headers = headers
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self._receive = receive

    async def body(self) -> bytes:
        """The whole body; raises :class:`BodyTooLargeError` as soon as it passes the cap."""
        limit = self.max_body_bytes
        declared = declared_length(self.headers)
        if limit is not None and declared is not None and declared > limit:
            raise BodyTooLargeError(limit, declared)
        chunks = []
        size = 0
        while True:
            if self.body_timeout is None:
                message = await self._receive()
            else:
                try:
                    async with asyncio.timeout(self.body_timeout):
                        message = await self._receive()
                except TimeoutError:
                    raise BodyTimeoutError(self.body_timeout) from None
            if message["type"] == "http.disconnect":
                raise ClientDisconnectedError()
            chunk = message.get("body", b"")
            size += len(chunk)
            if limit is not None and size > limit:
                raise BodyTooLargeError(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class Response:
    """A complete response body (JSON unless told otherwise)."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        body: bytes,
        status: int = 200,
        content_type: bytes = JSON,
        headers: Iterable[tuple[bytes, bytes]] = (),
    ):
        self.body, self.status = body, status
        self.headers = [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ]

    @classmethod
    def json(cls, content: Any, status: int = 200) -> Response:
        return cls(orjson.dumps(content), status)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


class StreamingResponse:
    """A body sent chunk by chunk as the (sync or async) iterator yields (server-sent events)."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes] | Iterable[bytes],
        content_type: bytes = b"text/event-stream",
        headers: dict[str, str] | None = None,
    ):
        self.chunks = chunks
        self.headers = [(b"content-type", content_type)] + [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()
        ]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        if isinstance(self.chunks, AsyncIterator):
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        else:
            for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


Endpoint = Callable[[Request], Awaitable[Any]]


def too_large_response(path: str, error: BodyTooLargeError) -> Response:
    """The default 413: JSON naming the limit; the connection closes (the rest is unread)."""
    body = {"error": {"message": str(error), "type": "request_too_large", "limit": error.limit}}
    return Response(orjson.dumps(body), 413, headers=[CLOSE])


class App:
    """An ASGI app over ``{path: {method: endpoint}}`` with an optional lifespan.

    ``max_body_bytes`` caps every request's body (declared lengths over it are answered by
    ``too_large`` without calling the endpoint); ``body_timeout`` bounds the wait for each
    part of a body.
    """

    def __init__(
        self,
        routes: dict[str, dict[str, Endpoint]],
        lifespan: Callable[[], contextlib.AbstractAsyncContextManager] | None = None,
        *,
        max_body_bytes: int | None = None,
        body_timeout: float | None = None,
        too_large: Callable[[str, BodyTooLargeError], Response] = too_large_response,
    ):
        self.routes = routes
        self.lifespan = lifespan
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.too_large = too_large

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        methods = self.routes.get(path) or self.routes.get(path.rstrip("/") or "/")
        if methods is None:
            response = Response.json({"error": {"message": f"no endpoint {path}"}}, 404)
        else:
            endpoint = methods.get(scope["method"])
            if endpoint is None:
                allow = ", ".join(sorted(methods)).encode()
                response = Response(
                    orjson.dumps({"error": {"message": f"{scope['method']} not allowed"}}),
                    405,
                    headers=[(b"allow", allow)],
                )
            else:
                request = Request(scope, receive, self.max_body_bytes, self.body_timeout)
                declared = declared_length(request.headers)
                limit = self.max_body_bytes
                if limit is not None and declared is not None and declared > limit:
                    response = self.too_large(path, BodyTooLargeError(limit, declared))
                else:
                    try:
                        response = await endpoint(request)
                    except ClientDisconnectedError:
                        return
        await response(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        context = self.lifespan() if self.lifespan is not None else contextlib.nullcontext()
        await receive()  # lifespan.startup
        try:
            await context.__aenter__()
        except Exception as e:
            await send({"type": "lifespan.startup.failed", "message": str(e)})
            return
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        try:
            await context.__aexit__(None, None, None)
        except Exception as e:
            await send({"type": "lifespan.shutdown.failed", "message": str(e)})
            return
        await send({"type": "lifespan.shutdown.complete"})
