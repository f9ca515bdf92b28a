"""HTTP to Arena: request specs, the retry policy, pooled clients and flow drivers.

Every Arena operation is written once, as a *flow*: a generator that yields
:class:`ArenaRequest` (or a list of them, sent concurrently when driven asynchronously,
or a :class:`Pause`) and receives the responses. :meth:`ArenaTransport.run` drives a flow
with a blocking ``httpx.Client`` and :meth:`ArenaTransport.arun` with an
``httpx.AsyncClient``, so the sync and async APIs share all their logic.

Retry policy (each request, ``retries + 1`` attempts): transport errors, HTTP 429, 5xx,
a 403 whose body carries the gateway's transient marker, and a 302 to the gateway's
upstream-502 waiting page are retried after 1, 2, 4, 8, 10, 10, ... seconds
(:func:`retry_policy`, an :class:`areal.utils.retry.RetryPolicy`). A request that exhausts
its attempts on a transport error fails naming only the exception class; one that
exhausts them on a retryable answer returns that answer.

URLs are checked with :func:`check_http_url`, whose errors name the setting and the
problem and show the URL only with its user-info, query values and fragment as ``***``.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote, urlsplit

import httpx

from areal.utils.retry import RetryPolicy
from areal.utils.secrets import REDACTED, SecretStr, redact_url, redact_urls, reveal
from examples.swe.arena_results import ArenaAPIError

__all__ = [
    "ArenaRequest",
    "ArenaTransport",
    "Flow",
    "Pause",
    "backoff_delay",
    "check_http_url",
    "encode_path",
    "is_retryable_response",
    "retry_policy",
    "url_problem",
]

T = TypeVar("T")
SPANNER_403_MARKER = "spanner-http-ant-group-watch-all"
UPSTREAM_502_REDIRECT = ("fromspanner", "apigwmoe_502")
_NO_BODY = object()


@dataclass(frozen=True)
class ArenaRequest:
    """One HTTP call: ``path`` is under the Arena base and already percent-encoded."""

    method: str
    path: str
    params: Mapping[str, str] | None = None
    json: Any = field(default=_NO_BODY)
    timeout: float | None = None  # None: the HTTP client's default


@dataclass(frozen=True)
class Pause:
    """Sleep this many seconds (blocking or not, as the driver dictates)."""

    seconds: float


Step = ArenaRequest | list[ArenaRequest] | Pause
Flow = Generator[Step, Any, T]


def encode_path(value: str) -> str:
    """Percent-encode a path parameter with no safe characters (``a/b`` -> ``a%2Fb``)."""
    return quote(str(value), safe="")


def url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as a plain http(s) base URL, or ``None``.

    A base URL has a scheme (http or https) and a host, and no whitespace, credentials,
    query, fragment or bad port: anything after the host and port is a path.
    """
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return "is not a valid URL"
    if any(c.isspace() for c in url):
        return "contains whitespace"
    if parts.scheme not in ("http", "https"):
        return "must use http or https"
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        return "must not contain credentials (user:password@); pass keys in their own settings"
    if not parts.hostname:
        return "has no host"
    if parts.query or parts.fragment or "?" in url or "#" in url:
        return "must not have a query or fragment"
    try:
        parts.port  # noqa: B018 - raises ValueError for an invalid port
    except ValueError:
        return "has an invalid port"
    return None


def check_http_url(url: str, what: str, source: str) -> str:
    """``url`` if it is a plain http(s) base URL, else ``ValueError`` naming ``source``.

    The message shows the URL with its secret parts as ``***`` (:func:`redact_url`).
    """
    problem = url_problem(url)
    if problem is not None:
        raise ValueError(f"{source} gives an invalid {what} {redact_url(url)!r}: {problem}")
    return url


def retry_policy(retries: int) -> RetryPolicy:
    """``retries + 1`` attempts, waiting 1, 2, 4, 8, 10, 10, ... seconds between them."""
    return RetryPolicy(attempts=retries + 1, first_delay=1.0, multiplier=2.0, max_delay=10.0)


def backoff_delay(attempt: int) -> float:
    """Seconds to wait after failed attempt ``attempt`` (0-based): 1, 2, 4, 8, 10, 10, ..."""
    return retry_policy(0).delay(attempt + 1)


def _is_transport_error(error: BaseException) -> bool:
    return isinstance(error, httpx.RequestError)


def is_retryable_response(response: httpx.Response) -> bool:
    status = response.status_code
    if status == 429 or status >= 500:
        return True
    if status == 403:
        return SPANNER_403_MARKER in response.text[:1000]
    if status == 302:
        query = parse_qs(
            urlsplit(response.headers.get("location", "")).query, keep_blank_values=True
        )
        key, value = UPSTREAM_502_REDIRECT
        return query.get(key) == [value]
    return False


CONNECTIONS_PER_SHARD = 4


class _AsyncShard:
    """A small ``httpx.AsyncClient`` (created on first use) and a gate that keeps its
    requests in flight <= its connections."""

    def __init__(self, make_client: Callable[[int], httpx.AsyncClient], size: int):
        self._make_client = make_client
        self.size = size
        self.client: httpx.AsyncClient | None = None
        self.gate = asyncio.Semaphore(size)
        self.in_flight = 0

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            self.client = self._make_client(self.size)
        return self.client


class _AsyncPool:
    """Several small async clients, used least-loaded first.

    httpcore scans every connection of a pool for every request it assigns, so one pool
    of 100 connections costs milliseconds of CPU per request under load. Shards of a few
    connections keep that scan short; the gates bound open connections to the total, and
    a lightly loaded pool only ever creates its first shard.
    """

    def __init__(self, make_client: Callable[[int], httpx.AsyncClient], max_connections: int):
        sizes = [CONNECTIONS_PER_SHARD] * (max_connections // CONNECTIONS_PER_SHARD)
        if max_connections % CONNECTIONS_PER_SHARD:
            sizes.append(max_connections % CONNECTIONS_PER_SHARD)
        self.shards = [_AsyncShard(make_client, size) for size in sizes]

    async def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        # Prefer the first shard with a free slot, so that idle shards stay uncreated.
        shard = min(self.shards, key=lambda s: s.in_flight >= s.size)
        if shard.in_flight >= shard.size:
            shard = min(self.shards, key=lambda s: s.in_flight / s.size)
        shard.in_flight += 1
        try:
            async with shard.gate:
                return await shard.http().request(method, url, **kwargs)
        finally:
            shard.in_flight -= 1

    @property
    def is_closed(self) -> bool:
        return any(s.client is not None and s.client.is_closed for s in self.shards)

    async def aclose(self) -> None:
        for shard in self.shards:
            if shard.client is not None:
                await shard.client.aclose()


class ArenaTransport:
    """Authenticated, retried HTTP to one Arena base URL, with pooled clients.

    One ``httpx.Client`` and one ``httpx.AsyncClient`` per event loop are created lazily
    and reused for every call that does not bring its own client.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        retries: int = 3,
        timeout: float | httpx.Timeout = 60.0,
        max_connections: int = 100,
        trust_env: bool = True,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], None] | None = None,
        async_sleep: Callable[[float], Awaitable[None]] | None = None,
        secrets: tuple[str, ...] = (),
        error_label: str = "Arena",
    ):
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"request retries must be an int >= 0, got {retries!r}")
        self.base_url = base_url.rstrip("/")
        self._token = SecretStr(token)  # stripped: a trailing newline breaks the header
        self.retries = retries
        self._policy = retry_policy(retries)
        self.timeout = timeout
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self._max_connections = max_connections
        self._limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        self._trust_env = trust_env
        self._transport = transport
        self._async_transport = async_transport
        self._sleep = sleep or time.sleep
        self._async_sleep = async_sleep or asyncio.sleep
        self._secrets = tuple(reveal(s).strip() for s in (token, *secrets) if reveal(s).strip())
        self._label = error_label
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._ssl_context: ssl.SSLContext | None = None
        self._async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AsyncPool] = (
            weakref.WeakKeyDictionary()
        )

    def __repr__(self) -> str:
        return f"ArenaTransport(base_url={redact_url(self.base_url)!r}, retries={self.retries})"

    # --- pooled clients ---

    def sync_client(self) -> httpx.Client:
        with self._lock:
            if self._client is None or self._client.is_closed:
                self._client = httpx.Client(
                    timeout=self.timeout,
                    limits=self._limits,
                    trust_env=self._trust_env,
                    transport=self._transport,
                    follow_redirects=False,
                )
            return self._client

    def _make_async_client(self, connections: int) -> httpx.AsyncClient:
        with self._lock:
            if self._ssl_context is None:  # one TLS context for every shard (~ms each)
                self._ssl_context = httpx.create_ssl_context(trust_env=self._trust_env)
        return httpx.AsyncClient(
            verify=self._ssl_context,
            timeout=self.timeout,
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            trust_env=self._trust_env,
            transport=self._async_transport,
            follow_redirects=False,
        )

    def async_client(self) -> _AsyncPool:
        """This event loop's pooled async clients (at most ``max_connections`` in all)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            pool = self._async_clients.get(loop)
            if pool is None or pool.is_closed:
                pool = _AsyncPool(self._make_async_client, self._max_connections)
                self._async_clients[loop] = pool
            return pool

    def close(self) -> None:
        """Close the pooled sync client (async clients close with :meth:`aclose`)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    async def aclose(self) -> None:
        """Close this event loop's pooled async clients."""
        loop = asyncio.get_running_loop()
        with self._lock:
            pool = self._async_clients.pop(loop, None)
        if pool is not None:
            await pool.aclose()

    # --- one request, with retries ---

    def _kwargs(self, request: ArenaRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "headers": {"Authorization": f"Bearer {self._token.reveal()}"},
            "params": dict(request.params) if request.params else None,
        }
        if request.json is not _NO_BODY:
            kwargs["json"] = request.json
        if request.timeout is not None:
            kwargs["timeout"] = request.timeout
        return kwargs

    def _invalid_url(self, request: ArenaRequest) -> ArenaAPIError:
        # httpx's message may quote the URL; only the path is shown.
        return ArenaAPIError(f"{self._label} {request.method} {request.path}: invalid URL")

    def _exhausted(self, request: ArenaRequest, exc: Exception) -> ArenaAPIError:
        attempts = self.retries + 1
        return ArenaAPIError(
            f"{self._label} {request.method} {request.path} request failed after {attempts} "
            f"attempt{'s' if attempts != 1 else ''} ({type(exc).__name__})"
        )

    def send(self, request: ArenaRequest, client: httpx.Client | None = None) -> httpx.Response:
        http = client or self.sync_client()
        url = self.base_url + request.path
        previous: list[httpx.Response] = []  # the last answer: closed if it is retried

        def attempt() -> httpx.Response:
            if previous:
                previous.pop().close()
            try:
                response = http.request(request.method, url, **self._kwargs(request))
            except httpx.InvalidURL:
                raise self._invalid_url(request) from None
            previous.append(response)
            return response

        try:
            return self._policy.call(
                attempt,
                retry_on_exception=_is_transport_error,
                retry_on_result=is_retryable_response,
                sleep=self._sleep,
            )
        except httpx.RequestError as exc:  # raised by the last attempt
            raise self._exhausted(request, exc) from None

    async def asend(
        self, request: ArenaRequest, client: httpx.AsyncClient | None = None
    ) -> httpx.Response:
        http = client or self.async_client()
        url = self.base_url + request.path
        previous: list[httpx.Response] = []

        async def attempt() -> httpx.Response:
            if previous:
                await previous.pop().aclose()
            try:
                response = await http.request(request.method, url, **self._kwargs(request))
            except httpx.InvalidURL:
                raise self._invalid_url(request) from None
            previous.append(response)
            return response

        try:
            return await self._policy.acall(
                attempt,
                retry_on_exception=_is_transport_error,
                retry_on_result=is_retryable_response,
                sleep=self._async_sleep,
            )
        except httpx.RequestError as exc:
            raise self._exhausted(request, exc) from None

    # --- response helpers ---

    def mask(self, text: str) -> str:
        """``text`` with the token (and other known secrets) replaced by ``<redacted>``, and
        the secret parts of any URL in it by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return redact_urls(text)

    def check_status(self, response: httpx.Response, request: ArenaRequest) -> None:
        if not 200 <= response.status_code < 300:
            body = self.mask(response.text[:500])
            raise ArenaAPIError(
                f"{self._label} {request.method} {request.path} returned HTTP "
                f"{response.status_code}: {body}"
            )

    def read_json(self, response: httpx.Response, request: ArenaRequest) -> Any:
        """The JSON body of a 2xx response; :class:`ArenaAPIError` otherwise."""
        self.check_status(response, request)
        try:
            return response.json()
        except ValueError:
            raise ArenaAPIError(
                f"{self._label} {request.method} {request.path} returned a non-JSON response"
            ) from None

    # --- flow drivers ---

    def run(self, flow: Flow[T], client: httpx.Client | None = None) -> T:
        """Drive a flow with blocking HTTP (lists of requests go one by one)."""
        try:
            step = next(flow)
            while True:
                if isinstance(step, Pause):
                    self._sleep(step.seconds)
                    step = flow.send(None)
                elif isinstance(step, list):
                    step = flow.send([self.send(r, client) for r in step])
                else:
                    step = flow.send(self.send(step, client))
        except StopIteration as stop:
            return stop.value

    async def arun(self, flow: Flow[T], client: httpx.AsyncClient | None = None) -> T:
        """Drive a flow without blocking the event loop (lists are sent concurrently)."""
        try:
            step = next(flow)
            while True:
                if isinstance(step, Pause):
                    await self._async_sleep(step.seconds)
                    step = flow.send(None)
                elif isinstance(step, list):
                    step = flow.send(await _gather_or_cancel(self.asend(r, client) for r in step))
                else:
                    step = flow.send(await self.asend(step, client))
        except StopIteration as stop:
            return stop.value


async def _gather_or_cancel(coros) -> list[Any]:
    """Await all; on the first failure cancel the rest (no orphaned requests) and re-raise."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
