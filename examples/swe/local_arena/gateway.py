"""The local Arena's LLM gateway (``{base}/api``): harness calls to registered upstreams.

A harness calls the gateway in its own protocol (chat completions, Responses or
Anthropic Messages) with the model name of a registered route. The gateway converts the
call to a chat-completions request (with the rollout proxy's own adapters), forwards it
to the route's upstream with the route's key, passes ``X-Session-Id`` and
``X-Session-Token`` through unchanged, and converts the completion back (streamed when
the harness asked for a stream). An unknown or deleted model is a 404 with an error
body, as is a disabled route. A call still waiting for its upstream when the server
stops is answered 503 at once, so a slow upstream cannot hold the shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from areal.proxy.adapters.protocols import (
    SSE_HEADERS,
    ProtocolRequestError,
    error_body,
    from_chat,
    sse_chunks,
    stream_events,
    to_chat,
)
from areal.proxy.keys import candidate_tokens
from examples.swe.local_arena.store import Store

__all__ = ["FORWARDED_HEADERS", "LLMGateway"]

FORWARDED_HEADERS = ("x-session-id", "x-session-token")
UPSTREAM_TIMEOUT = 900.0
T = TypeVar("T")


class _StoppingError(Exception):
    """The server began stopping while a call waited for its upstream."""


async def _unless_stopped(call: Awaitable[T], stopping: asyncio.Event | None) -> T:
    """The result of ``call``, or :class:`_StoppingError` as soon as ``stopping`` is set."""
    if stopping is None:
        return await call
    work = asyncio.ensure_future(call)
    halt = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({work, halt}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        halt.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
    if work.cancelled():
        raise _StoppingError
    return work.result()


def _json(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status, media_type="application/json")


class LLMGateway:
    """Serves harness LLM calls; ``accepts(key)`` decides which keys may call it."""

    def __init__(
        self,
        store: Store,
        accepts: Callable[[str], bool],
        stopping: asyncio.Event | None = None,
    ):
        self.store = store
        self.accepts = accepts
        self.stopping = stopping
        self.http: httpx.AsyncClient | None = None
        self.calls = 0  # forwarded calls, for tests and /health

    async def start(self) -> None:
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(UPSTREAM_TIMEOUT, connect=10.0))

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()
            self.http = None

    def models(self) -> dict[str, Any]:
        routes = [r for r in self.store.list_routes() if r.enabled]
        return {
            "object": "list",
            "data": [{"id": r.model_name, "object": "model", "owned_by": "arena"} for r in routes],
        }

    async def handle(self, protocol: str, request: Request) -> Response:
        def fail(status: int, message: str, kind: str, **extra: Any) -> Response:
            return _json(error_body(protocol, message, kind, **extra), status)

        tokens = candidate_tokens(request.headers)
        if not tokens:
            return fail(401, "missing API key (Authorization: Bearer or x-api-key)", "auth_error")
        if not any(self.accepts(t) for t in tokens):
            return fail(401, "this key may not call the LLM gateway", "authentication_error")
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return fail(400, "the request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return fail(400, "the request body must be a JSON object", "invalid_request_error")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return fail(400, "model is required (a registered model name)", "invalid_request_error")
        route = self.store.get_route(model)
        if route is None or not route.enabled:
            state = "is disabled" if route is not None else "is not registered (or was deleted)"
            return fail(404, f"model {model!r} {state} on this Arena", "not_found_error")
        try:
            translated = to_chat(protocol, body)
        except ProtocolRequestError as e:
            return fail(400, str(e), "invalid_request_error")

        chat = {k: v for k, v in translated.chat.items() if k not in ("stream", "stream_options")}
        chat["model"] = route.upstream_model
        headers = {"Authorization": f"Bearer {route.api_key}"}
        for name in FORWARDED_HEADERS:
            if name in request.headers:
                headers[name] = request.headers[name]
        assert self.http is not None, "start() the gateway first"
        url = f"{route.base_url.rstrip('/')}/chat/completions"
        self.calls += 1
        try:
            upstream = await _unless_stopped(
                self.http.post(
                    url,
                    content=orjson.dumps(chat),
                    headers={**headers, "Content-Type": "application/json"},
                ),
                self.stopping,
            )
        except _StoppingError:
            return fail(503, "the local Arena is stopping", "api_error")
        except httpx.HTTPError as e:
            return fail(502, f"upstream of {model!r} unreachable: {type(e).__name__}", "api_error")
        if upstream.status_code >= 400:
            return self._upstream_error(protocol, upstream)
        try:
            completion = upstream.json()
            reply = from_chat(translated, completion)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return fail(502, f"upstream of {model!r} sent an invalid completion: {e}", "api_error")
        if translated.stream:
            return StreamingResponse(
                sse_chunks(stream_events(translated, reply)),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        return _json(reply)

    @staticmethod
    def _upstream_error(protocol: str, upstream: httpx.Response) -> Response:
        """The upstream's error status and message, in the caller's protocol."""
        message, kind, extra = upstream.text[:2000], "api_error", {}
        try:
            payload = upstream.json()
            error = payload.get("error") if isinstance(payload, dict) else None
            if isinstance(error, dict):
                message = str(error.get("message", message))
                kind = str(error.get("type", kind))
            if isinstance(payload, dict) and "detail" in payload:
                extra["detail"] = payload["detail"]
        except ValueError:
            pass
        return _json(error_body(protocol, message, kind, **extra), upstream.status_code)
