"""API-key authentication of the embedded inference server, by SGLang's rules.

SGLang (``--api-key``, checked in 0.5.10.post1 through 0.5.23) answers every route with
401 unless the request carries ``Authorization: Bearer <key>`` (scheme case-insensitive,
the rest of the header compared in constant time). It leaves ``OPTIONS`` requests and
paths starting with ``/health``, ``/metrics`` or (from 0.5.20) ``/ready`` open, so that
liveness probes need no secret. This server applies the same rule, on its own code.

The key travels through the environment (:data:`API_KEY_ENV`), never on a command line.
"""

from __future__ import annotations

import secrets
from typing import Any

__all__ = [
    "API_KEY_ENV",
    "OPEN_PATH_PREFIXES",
    "APIKeyMiddleware",
    "bearer_matches",
    "send_json_error",
]

API_KEY_ENV = "AREAL_INFERENCE_API_KEY"
OPEN_PATH_PREFIXES = ("/health", "/metrics", "/ready")


def bearer_matches(authorization: bytes | None, key: bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>``."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(b" ")
    return scheme.lower() == b"bearer" and secrets.compare_digest(token, key)


async def send_json_error(
    send: Any, status: int, message: str, kind: str, extra_headers: list[tuple[bytes, bytes]] = ()
) -> None:
    """Answer with the server's error body ``{"error": {"message", "type", "param"}}``."""
    import orjson

    body = orjson.dumps({"error": {"message": message, "type": kind, "param": None}})
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """ASGI middleware: 401 for requests without the key, before any body is read."""

    def __init__(self, app: Any, api_key: str):
        if not api_key:
            raise ValueError("APIKeyMiddleware needs a non-empty key")
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        await send_json_error(
            send,
            401,
            "Unauthorized: send the server's API key as 'Authorization: Bearer <key>'",
            "authentication_error",
            [(b"www-authenticate", b"Bearer")],
        )

    def _allowed(self, scope: dict[str, Any]) -> bool:
        if scope["method"] == "OPTIONS" or scope["path"].startswith(OPEN_PATH_PREFIXES):
            return True
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        return bearer_matches(authorization, self._key)
