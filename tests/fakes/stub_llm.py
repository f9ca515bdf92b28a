"""An OpenAI-compatible chat-completions upstream for tests: scripted replies, recorded calls.

``StubLLM(reply)`` answers ``POST /chat/completions`` and ``/v1/chat/completions`` with
the text ``reply(body)`` returns (non-streaming, or as chunks when asked to stream), and
keeps every request's path, headers and body in ``calls``. ``delay`` holds each answer
back (to keep a task running; set it to 0 to release waiting calls), ``status`` makes
every answer an error.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from areal.proxy.adapters.protocols import sse_chunks, stream_events, to_chat


@dataclass
class Call:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class StubLLM:
    reply: Callable[[dict[str, Any]], str] = lambda body: "stub reply"
    delay: float = 0.0
    status: int = 200
    calls: list[Call] = field(default_factory=list)

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        text = self.reply(body)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "stub"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.calls.append(Call(request.url.path, dict(request.headers), body))
        started = time.monotonic()
        while time.monotonic() - started < self.delay:  # setting delay to 0 releases it
            await asyncio.sleep(0.02)
        if self.status != 200:
            error = {"error": {"message": "stub upstream failure", "type": "api_error"}}
            return Response(orjson.dumps(error), self.status, media_type="application/json")
        completion = self.completion(body)
        if body.get("stream"):
            events = stream_events(to_chat("chat_completions", body), completion)
            return StreamingResponse(sse_chunks(events), media_type="text/event-stream")
        return Response(orjson.dumps(completion), media_type="application/json")

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ]
        )


def last_user_text(body: dict[str, Any]) -> str:
    """The text of the last user message of a chat request (string or text blocks)."""
    for message in reversed(body.get("messages", [])):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "\n".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
            return str(content or "")
    return ""
