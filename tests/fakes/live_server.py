"""Serve an ASGI app (or a ScriptedHTTP peer) over real HTTP on loopback in a thread."""

from __future__ import annotations

import socket
from typing import Any

import httpx

from areal.utils.serving import serve_in_thread
from tests.fakes.scripted_http import ScriptedHTTP


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ScriptedASGI:
    """ASGI adapter: each request is answered by ``ScriptedHTTP.handler``."""

    def __init__(self, scripted: ScriptedHTTP):
        self.scripted = scripted

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        raw_path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        url = f"http://testserver{raw_path.decode()}" + (f"?{query.decode()}" if query else "")
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]]
        request = httpx.Request(scope["method"], url, headers=headers, content=body)
        response = self.scripted.handler(request)
        content = response.read()
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": [(k.encode(), v.encode()) for k, v in response.headers.items()],
            }
        )
        await send({"type": "http.response.body", "body": content})


def serve(app: Any, host: str = "127.0.0.1"):
    """Run ``app`` with uvicorn in a background thread; yields its base URL."""
    return serve_in_thread(app, host)
