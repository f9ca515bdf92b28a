"""The proxy's bare ASGI layer: routing, 404/405, bodies, streaming and the lifespan."""

from __future__ import annotations

import contextlib

import orjson
import pytest

from areal.proxy.asgi import App, Request, Response, StreamingResponse


async def call(app: App, method: str, path: str, body: bytes = b"", chunks: int = 1) -> dict:
    """Drive one HTTP request through the app; return status, headers and the body."""
    pieces = [body[i::chunks] for i in range(chunks)] if chunks > 1 else [body]
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
        for i, p in enumerate(pieces)
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(b"Authorization", b"Bearer first"), (b"authorization", b"Bearer second")],
    }
    await app(scope, receive, send)
    start, *bodies = sent
    return {
        "status": start["status"],
        "headers": dict(start["headers"]),
        "body": b"".join(m.get("body", b"") for m in bodies),
        "messages": len(bodies),
    }


async def echo(request: Request) -> Response:
    body = await request.body()
    return Response.json({"auth": request.headers["authorization"], "body": body.decode()})


async def stream(request: Request) -> StreamingResponse:
    async def chunks():
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    return StreamingResponse(chunks(), headers={"Cache-Control": "no-cache"})


APP = App({"/echo": {"POST": echo}, "/stream": {"GET": stream}})


@pytest.mark.asyncio
async def test_routes_read_headers_and_a_body_split_over_messages():
    reply = await call(APP, "POST", "/echo", b'{"a": 1, "b": [2, 3]}', chunks=3)
    assert reply["status"] == 200
    assert reply["headers"][b"content-type"] == b"application/json"
    assert int(reply["headers"][b"content-length"]) == len(reply["body"])
    # header names are case-insensitive and the first of repeated headers wins
    body = orjson.loads(reply["body"])
    assert body["auth"] == "Bearer first"
    assert sorted(body["body"]) == sorted('{"a": 1, "b": [2, 3]}')
    assert (await call(APP, "POST", "/echo/", b"x"))["status"] == 200  # trailing slash


@pytest.mark.asyncio
async def test_unknown_paths_and_methods_are_json_errors():
    missing = await call(APP, "GET", "/nope")
    assert missing["status"] == 404 and b"no endpoint /nope" in missing["body"]
    wrong = await call(APP, "GET", "/echo")
    assert wrong["status"] == 405 and wrong["headers"][b"allow"] == b"POST"
    assert orjson.loads(wrong["body"])["error"]["message"] == "GET not allowed"


@pytest.mark.asyncio
async def test_streaming_sends_each_chunk_then_ends():
    reply = await call(APP, "GET", "/stream")
    assert reply["headers"][b"content-type"] == b"text/event-stream"
    assert reply["headers"][b"cache-control"] == b"no-cache"
    assert reply["body"] == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert reply["messages"] == 4  # three chunks and the closing empty body


@pytest.mark.asyncio
async def test_lifespan_enters_and_exits_the_context():
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan():
        events.append("start")
        yield
        events.append("stop")

    app = App({}, lifespan=lifespan)
    inbox = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[str] = []

    async def receive() -> dict:
        return inbox.pop(0)

    async def send(message: dict) -> None:
        sent.append(message["type"])

    await app({"type": "lifespan"}, receive, send)
    assert events == ["start", "stop"]
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
