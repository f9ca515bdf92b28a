"""Front door of the RPC servers: signature checks, then the request limits.

:class:`SignedRequestGuard` wraps an ASGI app (a worker's RPC server). For each HTTP
request it checks the signature headers of
:mod:`areal.infra.rpc.auth` *before reading any body byte* (401 when they fail), then
reads the body under the limits of :mod:`areal.utils.http_limits` (413 for a body larger
than ``max_body_bytes``, from ``Content-Length`` or while reading a chunked body; 408 for
one that stalls ``body_timeout`` seconds between chunks), checks it against its signed
digest (400), and signs every answer to an accepted request, refusals included. Paths in
``open_paths`` also take unsigned ``GET`` requests (a liveness probe); the app sees
``scope["areal.authenticated"]`` (False for those) and must not reveal anything to them.

:data:`LIMIT_FLAGS` are the limit flags of a server started directly (the worker), and
:func:`uvicorn_options` its HTTP protocol: each request's line and headers within
``--header-timeout`` seconds of its first byte (or of connecting) and 64 KiB (else 400;
either way the connection closes), idle keep-alive connections closed after
``--idle-timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from typing import Any

from areal.infra.rpc.auth import (
    CONTENT_HEADER,
    SIGNATURE_HEADER,
    AuthError,
    ReplayCache,
    body_digest,
    check_request,
    max_clock_skew,
    sign_response,
)
from areal.infra.rpc.serialization import json_dumps
from areal.utils.http_limits import (
    BodyLimitMiddleware,
    Headers,
    HttpLimits,
    LimitFlags,
    Refusal,
    Scope,
    read_body,
    uvicorn_settings,
)
from areal.utils.secrets import reveal

__all__ = [
    "AUTH_SCOPE_KEY",
    "LIMITS",
    "LIMIT_FLAGS",
    "MAX_BODY_BYTES_ENV",
    "SignedRequestGuard",
    "uvicorn_options",
]

AUTH_SCOPE_KEY = "areal.authenticated"
_DIGEST_SCOPE_KEY = "areal.content_sha256"  # the signed body digest, for _DigestCheck
MAX_BODY_BYTES_ENV = "AREAL_RPC_MAX_BODY_BYTES"
LIMITS = HttpLimits(
    max_body_bytes=1 << 30,  # 1 GiB: a training batch travels by value in /call
    body_timeout=60.0,  # seconds of silence allowed between two body chunks
    header_timeout=15.0,
    max_header_bytes=64 * 1024,
    keep_alive_timeout=30,
    changed_by={
        "max_body_bytes": f"the server's limit: --max-body-bytes or ${MAX_BODY_BYTES_ENV}",
        "max_header_bytes": None,  # fixed: no flag
    },
)
"""The RPC servers' request limits by default (the worker's flags change them)."""
LIMIT_FLAGS = LimitFlags(
    LIMITS,
    ("--max-body-bytes", "--header-timeout", "--body-timeout", "--idle-timeout"),
    env={"--max-body-bytes": MAX_BODY_BYTES_ENV},
)
_INLINE_HASH_BYTES = 1 << 20  # bodies from this size are hashed on a thread


def limit_error(refusal: Refusal, scope: Scope | None) -> tuple[Headers, bytes]:
    """A refusal by the request limits, as every RPC error: ``{"error": message}``."""
    return [(b"content-type", b"application/json")], json_dumps({"error": refusal.message})


def uvicorn_options(limits: HttpLimits = LIMITS) -> dict[str, Any]:
    """uvicorn settings of a worker: the HTTP protocol with its header limits, idle timeout.

    Late headers close the connection without an answer, and headers over the cap get
    400, as they always have on these servers.
    """
    return uvicorn_settings(
        limits, error_shape=limit_error, header_timeout_reply="never", header_limit_status=400
    )


class _ReplyError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _headers(scope: Scope) -> dict[str, str]:
    """Lower-case header names to values; a repeated signature header is refused."""
    out: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1").lower()
        if name in out and name.startswith("x-areal-"):
            raise _ReplyError(401, f"header {name} given twice")
        out[name] = raw_value.decode("latin-1")
    return out


def _target(scope: Scope) -> str:
    raw = scope.get("raw_path") or scope["path"].encode("utf-8")
    query = scope.get("query_string") or b""
    return (raw + (b"?" + query if query else b"")).decode("latin-1")


def _split_authority(authority: str) -> tuple[str, int]:
    if authority.startswith("["):
        host, _, rest = authority[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = authority.rpartition(":") if ":" in authority else (authority, "", "")
    return host.lower(), int(port) if port.isdigit() else 80


def _normal_ip(host: str) -> str:
    host = host.lower()
    return host[7:] if host.startswith("::ffff:") else host


def _is_loopback(host: str) -> bool:
    host = _normal_ip(host)
    return host in ("localhost", "::1") or host.startswith("127.")


def _names_this_server(authority: str, server: Any) -> bool:
    """Whether a signed ``Host`` value names the socket this request arrived on."""
    if not server or server[1] is None:
        return True  # an in-process transport or a Unix socket: no address to compare
    host, port = _split_authority(authority)
    local_host, local_port = _normal_ip(str(server[0])), int(server[1])
    if port != local_port:
        return False
    return _normal_ip(host) == local_host or (_is_loopback(host) and _is_loopback(local_host))


class SignedRequestGuard:
    """ASGI wrapper that admits only signed requests and signs its answers.

    ``token`` is the run's RPC token; ``open_paths`` take unsigned ``GET``/``HEAD``
    (the app sees ``scope["areal.authenticated"] = False``); ``max_body_bytes`` caps a
    request body (413); ``body_timeout`` bounds the silence between body chunks (408);
    ``max_skew`` is the replay window in seconds (default :func:`max_clock_skew`).
    """

    def __init__(
        self,
        app: Any,
        token: str,
        *,
        open_paths: Iterable[str] = (),
        max_body_bytes: int = LIMITS.max_body_bytes,
        body_timeout: float = LIMITS.body_timeout,
        max_skew: float | None = None,
    ):
        if not reveal(token):
            raise ValueError("SignedRequestGuard needs the run's RPC token")
        self.app = app
        self._token = token
        self.open_paths = frozenset(open_paths)
        self.limits = dataclasses.replace(
            LIMITS, max_body_bytes=max_body_bytes, body_timeout=body_timeout
        )
        self._limited = BodyLimitMiddleware(self._checked, self.limits, limit_error)
        self.max_skew = max_clock_skew() if max_skew is None else max_skew
        self.replay = ReplayCache(self.max_skew)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            headers = _headers(scope)
            if (
                SIGNATURE_HEADER.lower() not in headers
                and scope["path"] in self.open_paths
                and scope["method"] in ("GET", "HEAD")
            ):
                await self.app({**scope, AUTH_SCOPE_KEY: False}, receive, send)
                return
            signed = self._admit(scope, headers)
        except _ReplyError as e:
            await _send_json(send, e.status, str(e))
            return
        signing_send = _SigningSend(send, self._token, signed.nonce)
        scope = {**scope, AUTH_SCOPE_KEY: True, _DIGEST_SCOPE_KEY: signed.content_sha256}
        try:
            await self._limited(scope, receive, signing_send)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError) or signing_send.started:
                raise
            # the app failed without answering: uvicorn's own 500 would go unsigned, and
            # the client would take this server's failure for an impostor's answer
            await _send_json(signing_send, 500, f"the server failed: {type(e).__name__}: {e}")
            raise

    async def _checked(self, scope: Scope, receive: Any, send: Any) -> None:
        """The app, once the whole body (read under the limits) matches its signed digest."""
        body = await read_body(receive)
        if body is None:
            # gone, or refused by the limits (then this answer is dropped)
            await _send_json(send, 400, "the client went away before sending the whole body")
        elif await _digest(body) != scope[_DIGEST_SCOPE_KEY]:
            await _send_json(send, 400, f"the body does not match its {CONTENT_HEADER}")
        else:
            await self.app(scope, _replay_body(body, receive), send)

    def _admit(self, scope: Scope, headers: dict[str, str]) -> Any:
        host = headers.get("host", "")
        try:
            signed = check_request(
                self._token, scope["method"], host, _target(scope), headers, skew=self.max_skew
            )
            if not _names_this_server(host, scope.get("server")):
                raise AuthError(f"the request was signed for another server (Host {host!r})")
            # the clock reading of the timestamp check: a later one could let a replay in
            self.replay.use(signed.nonce, signed.timestamp, now=signed.checked_at)
        except AuthError as e:
            raise _ReplyError(401, str(e)) from None
        return signed


async def _digest(body: bytes) -> str:
    """SHA-256 of ``body``; a large one off the event loop, which serves health checks."""
    if len(body) < _INLINE_HASH_BYTES:
        return body_digest(body)
    return await asyncio.to_thread(body_digest, body)


def _replay_body(body: bytes, receive: Any) -> Any:
    delivered = False

    async def replay() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect, as ASGI does

    return replay


class _SigningSend:
    """Buffers one answer and sends it with ``X-Areal-Signature`` for the request nonce."""

    def __init__(self, send: Any, token: str, nonce: str):
        self._send = send
        self._token = token
        self._nonce = nonce
        self._start: dict[str, Any] | None = None
        self._chunks: list[bytes] = []

    @property
    def started(self) -> bool:
        """Whether the app began its answer."""
        return self._start is not None

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self._start = message
            return
        if message["type"] != "http.response.body" or self._start is None:
            await self._send(message)
            return
        self._chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(self._chunks)
        status = int(self._start["status"])
        if len(body) < _INLINE_HASH_BYTES:
            signature = sign_response(self._token, status, self._nonce, body)
        else:
            signature = await asyncio.to_thread(
                sign_response, self._token, status, self._nonce, body
            )
        headers = [
            (k, v)
            for k, v in self._start.get("headers", [])
            if k.lower() != SIGNATURE_HEADER.lower().encode()
        ]
        headers.append((SIGNATURE_HEADER.lower().encode(), signature.encode()))
        await self._send({**self._start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send: Any, status: int, message: str) -> None:
    body = json_dumps({"error": message})
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
