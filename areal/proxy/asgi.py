"""The proxy's HTTP layer: exact-path routing and JSON/SSE responses on bare ASGI.

Every proxy endpoint takes a JSON body and answers JSON or server-sent events, and each
handler maps its own errors to statuses, so a framework's routing, middleware and
request objects would only add per-request cost on the hot path. :class:`App` routes by
exact path and method (404 and 405 answered as JSON), runs a lifespan context, and hands
handlers a :class:`Request` with lower-cased headers and the body. Body limits are
:class:`areal.utils.http_limits.BodyLimitMiddleware`'s, in front of the app.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import orjson

from areal.utils.http_limits import read_body

__all__ = [
    "App",
    "ClientDisconnectedError",
    "Request",
    "Response",
    "StreamingResponse",
]

JSON = b"application/json"


class ClientDisconnectedError(Exception):
    """The client went away before its request body arrived."""


class Request:
    """Headers (names lower-cased; the first of repeated names wins) and the body."""

    __slots__ = ("_receive", "headers", "method", "path")

    def __init__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]]):
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1").lower()
            if key not in headers:
                headers[key] = value.decode("latin-1")
        self.headers = headers
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self._receive = receive

    async def body(self) -> bytes:
        """The whole body; raises :class:`ClientDisconnectedError` if it never came."""
        body = await read_body(self._receive)
        if body is None:
            raise ClientDisconnectedError()
        return body


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


class App:
    """An ASGI app over ``{path: {method: endpoint}}`` with an optional lifespan."""

    def __init__(
        self,
        routes: dict[str, dict[str, Endpoint]],
        lifespan: Callable[[], contextlib.AbstractAsyncContextManager] | None = None,
    ):
        self.routes = routes
        self.lifespan = lifespan

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
                try:
                    response = await endpoint(Request(scope, receive))
                except ClientDisconnectedError:
                    return  # gone, or refused by the body limits: nothing more to send
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
