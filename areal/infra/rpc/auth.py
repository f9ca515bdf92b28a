"""Signed RPC messages: HMAC-SHA256 with the run's token, which itself never travels.

The controller and its workers share one secret, the
run's RPC token (``$AREAL_RPC_TOKEN``). Nothing puts it on the wire: each request and
each answer carries an HMAC-SHA256, keyed with the token's UTF-8 bytes, over what it
says. A process that does not hold the token can neither forge a request nor pass for
a worker (its answers would not verify), and what it overhears cannot be replayed.

Wire format, version 1. A request carries four headers:

==========================  ==========================================================
``X-Areal-Timestamp``       the sender's clock, integer Unix seconds
``X-Areal-Nonce``           32 lowercase hex digits (128 random bits), fresh per request
``X-Areal-Content-SHA256``  lowercase hex SHA-256 of the body as sent (empty body too)
``X-Areal-Signature``       lowercase hex HMAC-SHA256 over the request string below
==========================  ==========================================================

The request string is these lines joined by ``\\n``: ``AREAL-RPC-HMAC-SHA256-V1``,
``request``, the method (upper case), the ``Host`` header as sent, the request target
(raw path plus ``?query`` if any), the timestamp, the nonce and the body digest. The
``Host`` line ties a request to the server it was meant for, so a relay cannot hand it
to another one. A receiver checks, in this order: the four headers are present and
well formed; the signature (:func:`hmac.compare_digest`); the timestamp within
``±MAX_CLOCK_SKEW`` seconds (60 by default, ``$AREAL_RPC_MAX_CLOCK_SKEW``) of its own
clock; that ``Host`` names it; that the nonce was not seen before (:class:`ReplayCache`);
and, once read, that the body matches its digest. Any failure is a ``401`` whose body
says which check failed, unsigned, before the body is read. The timestamp check and the
replay cache judge a request by one reading of the clock (:attr:`SignedRequest.checked_at`),
and the cache keeps each nonce a second past the window: a request the timestamp check
still accepts always finds its nonce remembered, even at the very edge of the window.

An answer to an accepted request carries ``X-Areal-Signature``: the HMAC over
``AREAL-RPC-HMAC-SHA256-V1``, ``response``, the status code, the *request's* nonce and
the hex SHA-256 of the response body, joined by ``\\n``. It binds the answer to the
request and proves the server holds the token. Clients refuse any answer that does not
verify, except an unsigned ``401`` (a server refusing the request cannot sign for a
request it did not accept), which only ever becomes an error.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import re
import secrets
import threading
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from areal.utils.secrets import reveal

__all__ = [
    "CLOCK_SKEW_ENV",
    "CONTENT_HEADER",
    "MAX_CLOCK_SKEW",
    "NONCE_CACHE_SIZE",
    "NONCE_HEADER",
    "SIGNATURE_HEADER",
    "SIGNED_HEADERS",
    "TIMESTAMP_HEADER",
    "AuthError",
    "ReplayCache",
    "RequestSigner",
    "SignatureError",
    "SignedRequest",
    "body_digest",
    "check_request",
    "max_clock_skew",
    "sign_request",
    "sign_response",
    "signed_headers",
    "verify_response",
]

SCHEME = "AREAL-RPC-HMAC-SHA256-V1"
TIMESTAMP_HEADER = "X-Areal-Timestamp"
NONCE_HEADER = "X-Areal-Nonce"
CONTENT_HEADER = "X-Areal-Content-SHA256"
SIGNATURE_HEADER = "X-Areal-Signature"
SIGNED_HEADERS = (TIMESTAMP_HEADER, NONCE_HEADER, CONTENT_HEADER, SIGNATURE_HEADER)

MAX_CLOCK_SKEW = 60.0  # seconds a timestamp may differ from the receiver's clock
CLOCK_SKEW_ENV = "AREAL_RPC_MAX_CLOCK_SKEW"
NONCE_CACHE_SIZE = 262_144  # nonces remembered; see ReplayCache for what happens when full

_HEX64 = re.compile(r"[0-9a-f]{64}")
_NONCE = re.compile(r"[0-9a-f]{32}")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")


class SignatureError(Exception):
    """An answer that does not prove its sender holds the run's token."""


class AuthError(Exception):
    """A request refused by :func:`check_request` (the message says which check)."""


def max_clock_skew() -> float:
    """``$AREAL_RPC_MAX_CLOCK_SKEW`` seconds if set, else :data:`MAX_CLOCK_SKEW`."""
    raw = os.environ.get(CLOCK_SKEW_ENV, "")
    try:
        value = float(raw) if raw else MAX_CLOCK_SKEW
    except ValueError:
        raise ValueError(f"${CLOCK_SKEW_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"${CLOCK_SKEW_ENV} must be positive (got {raw!r})")
    return value


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _mac(token: str, *lines: str) -> str:
    message = "\n".join((SCHEME, *lines)).encode("utf-8")
    return hmac.new(reveal(token).encode("utf-8"), message, hashlib.sha256).hexdigest()


def sign_request(
    token: str,
    method: str,
    host: str,
    target: str,
    body: bytes,
    *,
    timestamp: int | None = None,
    nonce: str | None = None,
) -> dict[str, str]:
    """The four signature headers of a request to ``host`` for ``target`` (path?query)."""
    ts = str(int(time.time()) if timestamp is None else timestamp)
    nonce = nonce or secrets.token_hex(16)
    digest = body_digest(body)
    signature = _mac(token, "request", method.upper(), host, target, ts, nonce, digest)
    return {
        TIMESTAMP_HEADER: ts,
        NONCE_HEADER: nonce,
        CONTENT_HEADER: digest,
        SIGNATURE_HEADER: signature,
    }


def signed_headers(token: str, method: str, url: str, body: bytes) -> dict[str, str]:
    """Signature headers for ``method url`` with ``body``, for clients other than httpx.

    ``Host`` is taken as HTTP clients send it for an ``http://host:port/...`` URL
    (``host:port``; ``[v6]:port``), so the URL must carry an explicit port.
    """
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return sign_request(token, method, parts.netloc, target, body)


def sign_response(token: str, status: int, nonce: str, body: bytes) -> str:
    return _mac(token, "response", str(status), nonce, body_digest(body))


def verify_response(
    token: str, status: int, nonce: str, headers: Mapping[str, str], body: bytes
) -> None:
    """Raise :class:`SignatureError` unless the answer is signed for request ``nonce``."""
    presented = headers.get(SIGNATURE_HEADER, "")
    if not presented:
        raise SignatureError(f"the answer (HTTP {status}) is not signed")
    expected = sign_response(token, status, nonce, body)
    if not hmac.compare_digest(presented.encode("latin-1"), expected.encode("ascii")):
        raise SignatureError(f"the answer (HTTP {status}) has a wrong signature")


class RequestSigner(httpx.Auth):
    """httpx auth: signs every request, and checks the answer's signature.

    Each send gets a fresh timestamp and nonce, so a retried request is a new request.
    An answer that does not verify raises :class:`SignatureError` out of the send.
    """

    requires_request_body = True
    requires_response_body = True

    def __init__(self, token: str):
        if not reveal(token):
            raise ValueError("an RPC token is required to sign requests")
        self._token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        target = request.url.raw_path.decode("ascii")
        signature = sign_request(
            self._token, request.method, request.headers["host"], target, request.content
        )
        request.headers.update(signature)
        response = yield request
        if response.status_code == 401 and SIGNATURE_HEADER not in response.headers:
            return  # a refusal: the caller turns it into an error, never into a result
        verify_response(
            self._token,
            response.status_code,
            signature[NONCE_HEADER],
            response.headers,
            response.content,
        )


@dataclass(frozen=True)
class SignedRequest:
    """What :func:`check_request` accepted: the nonce answers are signed for."""

    timestamp: int
    nonce: str
    content_sha256: str
    checked_at: float
    """The receiver's clock when the timestamp was checked: pass it to
    :meth:`ReplayCache.use`, so both checks judge the request at the same instant."""


def check_request(
    token: str,
    method: str,
    host: str,
    target: str,
    headers: Mapping[str, str],
    *,
    now: float | None = None,
    skew: float | None = None,
) -> SignedRequest:
    """Check the headers' signature and timestamp (not the nonce, not the body) at ``now``
    (default: the clock, read once); the result carries that reading for the replay cache."""
    values = {}
    for name in SIGNED_HEADERS:
        value = headers.get(name.lower())
        if value is None:
            raise AuthError(
                f"missing {name} header: requests must be signed with the run's RPC token "
                "(areal.infra.rpc.auth)"
            )
        values[name] = value
    ts, nonce = values[TIMESTAMP_HEADER], values[NONCE_HEADER]
    digest, signature = values[CONTENT_HEADER], values[SIGNATURE_HEADER]
    if not _TIMESTAMP.fullmatch(ts):
        raise AuthError(f"{TIMESTAMP_HEADER} must be integer Unix seconds")
    if not _NONCE.fullmatch(nonce):
        raise AuthError(f"{NONCE_HEADER} must be 32 lowercase hex digits")
    if not (_HEX64.fullmatch(digest) and _HEX64.fullmatch(signature)):
        raise AuthError(f"{CONTENT_HEADER} and {SIGNATURE_HEADER} must be 64 hex digits")
    expected = _mac(token, "request", method.upper(), host, target, ts, nonce, digest)
    if not hmac.compare_digest(signature.encode("ascii"), expected.encode("ascii")):
        raise AuthError("wrong signature (the sender does not hold this run's RPC token)")
    now = time.time() if now is None else now
    skew = max_clock_skew() if skew is None else skew
    offset = int(ts) - now
    if abs(offset) > skew:
        raise AuthError(
            f"{TIMESTAMP_HEADER} is {offset:+.0f}s from this server's clock (allowed "
            f"±{skew:.0f}s): a replayed request, or clocks out of sync (run NTP, or raise "
            f"${CLOCK_SKEW_ENV} on both ends)"
        )
    return SignedRequest(int(ts), nonce, digest, now)


class ReplayCache:
    """Nonces accepted within the replay window; each may be used once.

    Pass ``now`` from :attr:`SignedRequest.checked_at`: with a clock of its own, the cache
    could read a later instant than the timestamp check and forget a nonce whose request
    that check still accepted. A nonce is remembered until its timestamp is ``window``
    plus :attr:`RETENTION_MARGIN` seconds old, past the last instant the timestamp check
    accepts it. Every forgotten nonce, for age or because ``capacity`` nonces are
    remembered, raises a floor: requests at least as old as it are refused from then on,
    so a forgotten nonce can never be accepted again, even if the clock steps back
    (legitimate senders sign with a fresh timestamp and are not affected in practice).
    """

    RETENTION_MARGIN = 1.0
    """Seconds a nonce is kept past the window (timestamps are whole seconds)."""

    def __init__(self, window: float, capacity: int = NONCE_CACHE_SIZE):
        self.window = window
        self.capacity = capacity
        self._seen: dict[str, int] = {}
        self._by_time: list[tuple[int, str]] = []
        self._floor = -1  # requests with timestamp <= floor are refused
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def use(self, nonce: str, timestamp: int, now: float | None = None) -> None:
        """Record ``nonce``; :class:`AuthError` if it was used before (or is forgotten)."""
        now = time.time() if now is None else now
        oldest_kept = now - self.window - self.RETENTION_MARGIN
        with self._lock:
            while self._by_time and self._by_time[0][0] < oldest_kept:
                self._forget()
            if timestamp <= self._floor:
                raise AuthError(
                    "request too old for the replay cache (older than the nonces it still "
                    "holds); sign it again"
                )
            if nonce in self._seen:
                raise AuthError(f"replayed request ({NONCE_HEADER} already used)")
            if len(self._seen) >= self.capacity:
                self._forget()
            self._seen[nonce] = timestamp
            heapq.heappush(self._by_time, (timestamp, nonce))

    def _forget(self) -> None:
        """Forget the oldest nonce; the floor rises to its timestamp (see the class doc)."""
        oldest, nonce = heapq.heappop(self._by_time)
        self._seen.pop(nonce, None)
        self._floor = max(self._floor, oldest)
