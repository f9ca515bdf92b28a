"""A scripted HTTP peer for httpx.MockTransport: canned responses per route, requests kept."""

from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

Reply = httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]


@dataclass
class Seen:
    """One request as the server received it."""

    method: str
    raw_path: str  # percent-encoded, without the query
    params: dict[str, str]
    headers: httpx.Headers
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def reply(status: int = 200, payload: Any = None, **kwargs: Any) -> httpx.Response:
    if payload is None:
        return httpx.Response(status, **kwargs)
    return httpx.Response(status, json=payload, **kwargs)


class ScriptedHTTP:
    """Routes ``(method, raw path)`` to queued replies; the last reply of a route repeats."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], deque[Reply]] = defaultdict(deque)
        self.requests: list[Seen] = []

    def on(self, method: str, raw_path: str, *replies: Reply) -> ScriptedHTTP:
        self.routes[(method, raw_path)].extend(replies)
        return self

    def handler(self, request: httpx.Request) -> httpx.Response:
        raw_path = request.url.raw_path.decode().split("?", 1)[0]
        self.requests.append(
            Seen(
                request.method, raw_path, dict(request.url.params), request.headers, request.read()
            )
        )
        queue = self.routes.get((request.method, raw_path))
        if not queue:
            return httpx.Response(404, json={"error": f"no route {request.method} {raw_path}"})
        item = queue.popleft() if len(queue) > 1 else queue[0]
        if isinstance(item, Exception):
            raise item
        if callable(item):
            return item(request)
        # A fresh copy each time: a route's last reply may be served repeatedly.
        return httpx.Response(item.status_code, headers=item.headers, content=item.content)

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)

    def calls(self, method: str | None = None, raw_path: str | None = None) -> list[Seen]:
        return [
            r
            for r in self.requests
            if (method is None or r.method == method)
            and (raw_path is None or r.raw_path == raw_path)
        ]
