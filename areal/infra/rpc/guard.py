"""Front door of the RPC servers: signature checks, body-size cap, header and body timeouts.

:class:`SignedRequestGuard` wraps an ASGI app (a worker's RPC server, the controller's
callback server). For each HTTP request it checks the signature headers of
:mod:`areal.infra.rpc.auth` *before reading any body byte* (401 when they fail), then
refuses a body larger than ``max_body_bytes`` (413, from ``Content-Length`` or while
reading a chunked body) or one that stalls for ``body_timeout`` seconds between chunks
(408), checks the body against its signed digest (400), and signs every answer to an
accepted request. Paths in ``open_paths`` also take unsigned ``GET`` requests (a
liveness probe); the app sees ``scope["areal.authenticated"]`` (False for those) and
must not reveal anything to them.

:func:`guarded_http_protocol` is the uvicorn protocol for a server started directly
(the worker): a connection must finish each request's headers within
``header_timeout`` seconds of its first byte (or of connecting), and the request line
plus headers may not exceed ``max_header_bytes`` (else 400 and the connection closes);
idle keep-alive connections are closed by uvicorn's ``timeout_keep_alive``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
from areal.utils.secrets import reveal

__all__ = [
    "AUTH_SCOPE_KEY",
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_HEADER_TIMEOUT",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_HEADER_BYTES",
    "MAX_BODY_BYTES_ENV",
    "SignedRequestGuard",
    "add_limit_arguments",
    "check_limit_arguments",
    "guarded_http_protocol",
    "limit_from_env",
]

AUTH_SCOPE_KEY = "areal.authenticated"
MAX_BODY_BYTES_ENV = "AREAL_RPC_MAX_BODY_BYTES"
DEFAULT_MAX_BODY_BYTES = 1 << 30  # 1 GiB: a training batch travels by value in /call
DEFAULT_BODY_TIMEOUT = 60.0  # seconds of silence allowed between two body chunks
DEFAULT_HEADER_TIMEOUT = 15.0  # seconds to send a request's line and headers
DEFAULT_IDLE_TIMEOUT = 30  # seconds an idle keep-alive connection stays open
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
_INLINE_HASH_BYTES = 1 << 20  # bodies from this size are hashed on a thread

Scope = dict[str, Any]


def limit_from_env(name: str, default: float, kind: type = float) -> Any:
    """A positive number from ``$name``, else ``default``; a clear error if malformed."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not a {kind.__name__}") from None
    if value <= 0:
        raise ValueError(f"${name} must be positive (got {raw!r})")
    return value


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``limits`` flags of a server command line (see the module docstring)."""
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help=f"Largest request body, bytes; 413 beyond (default ${MAX_BODY_BYTES_ENV}, "
        f"else {DEFAULT_MAX_BODY_BYTES}).",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        help="Seconds a connection has to send a request's line and headers.",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        help="Seconds of silence allowed between two chunks of a request body (408).",
    )
    limits.add_argument(
        "--idle-timeout",
        type=int,
        default=DEFAULT_IDLE_TIMEOUT,
        help="Seconds an idle keep-alive connection stays open.",
    )


def check_limit_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill ``--max-body-bytes`` from the environment; every limit must be positive."""
    if args.max_body_bytes is None:
        try:
            args.max_body_bytes = limit_from_env(MAX_BODY_BYTES_ENV, DEFAULT_MAX_BODY_BYTES, int)
        except ValueError as e:
            parser.error(str(e))
    for flag in ("max_body_bytes", "header_timeout", "body_timeout", "idle_timeout"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")


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
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        max_skew: float | None = None,
    ):
        if not reveal(token):
            raise ValueError("SignedRequestGuard needs the run's RPC token")
        self.app = app
        self._token = token
        self.open_paths = frozenset(open_paths)
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
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
        try:
            body = await self._read_body(headers, receive)
            if await _digest(body) != signed.content_sha256:
                raise _ReplyError(400, f"the body does not match its {CONTENT_HEADER}")
        except _ReplyError as e:
            await _send_json(signing_send, e.status, str(e))
            return
        await self.app({**scope, AUTH_SCOPE_KEY: True}, _replay_body(body, receive), signing_send)

    def _admit(self, scope: Scope, headers: dict[str, str]) -> Any:
        host = headers.get("host", "")
        try:
            signed = check_request(
                self._token, scope["method"], host, _target(scope), headers, skew=self.max_skew
            )
            if not _names_this_server(host, scope.get("server")):
                raise AuthError(f"the request was signed for another server (Host {host!r})")
            self.replay.use(signed.nonce, signed.timestamp)
        except AuthError as e:
            raise _ReplyError(401, str(e)) from None
        return signed

    async def _read_body(self, headers: dict[str, str], receive: Any) -> bytes:
        declared = headers.get("content-length", "")
        too_big = _ReplyError(
            413,
            f"request body over {self.max_body_bytes} bytes (the server's limit: "
            f"--max-body-bytes or ${MAX_BODY_BYTES_ENV})",
        )
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_big
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                raise _ReplyError(408, f"no body data for {self.body_timeout:.0f}s") from None
            if message["type"] == "http.disconnect":
                raise _ReplyError(400, "the client went away before sending the whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_big
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


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


def guarded_http_protocol(
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> type:
    """uvicorn's httptools protocol with a header deadline and a header-size cap."""
    import httptools  # noqa: F401  (uvicorn's fast parser; a declared dependency)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0
            self._arm()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > max_header_bytes:
                # raised inside the parser: uvicorn answers 400 and closes the connection
                raise ValueError(f"request headers over {max_header_bytes} bytes")

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedHttpToolsProtocol
