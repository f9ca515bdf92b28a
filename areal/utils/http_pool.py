"""A small keep-alive HTTP/1.1 client for the engine's hot path (JSON POSTs to servers).

The rollout proxy sends one ``/generate`` per chat call to an inference server on the
same network; a general-purpose client spends more CPU per request than the proxy's own
work. :class:`HTTPPool` keeps idle connections per ``host:port`` and parses responses
with ``httptools`` (the parser uvicorn uses), nothing more: no TLS, no redirects, no
cookies, no proxies. Bodies may be sized or chunked; a reused connection that the server
closed while idle is retried once on a fresh one, before any response byte arrived.

    pool = HTTPPool()
    status, body = await pool.request("POST", "10.0.0.5:30000", "/generate", payload, 60.0)
    await pool.close()
"""

from __future__ import annotations

import asyncio
import collections

import httptools

__all__ = ["HTTPPool", "HTTPPoolError"]

MAX_IDLE_PER_HOST = 1024


class HTTPPoolError(ConnectionError):
    """The connection failed or the peer sent something that is not HTTP/1.1."""


class _Connection(asyncio.Protocol):
    """One TCP connection; at most one request in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None
        self.body: list[bytes] = []
        self.received = False  # any byte of the current response
        self.headers_done = False
        self.keep_alive = False  # read when the headers end: the parser forgets it later
        self.lost = False

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(HTTPPoolError(f"malformed HTTP response: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if self.headers_done and not self.keep_alive:
            self.on_message_complete()  # a body delimited by the connection closing
        else:
            self._fail(HTTPPoolError(f"connection closed before the response ended: {exc}"))

    # --- httptools callbacks ---

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), b"".join(self.body)))

    # --- use ---

    @property
    def usable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def send(self, data: bytes) -> asyncio.Future:
        assert self.transport is not None and self.waiter is None
        self.waiter = asyncio.get_running_loop().create_future()
        self.body, self.received, self.headers_done, self.keep_alive = [], False, False, False
        self.transport.write(data)
        return self.waiter

    def finish(self) -> bool:
        """Ready the connection for reuse; ``False`` when it cannot be reused."""
        self.waiter = None
        keep = self.usable and self.keep_alive
        if keep:
            self.parser = httptools.HttpResponseParser(self)
        return keep

    def _fail(self, error: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class HTTPPool:
    """Keep-alive connections per ``host:port`` for one event loop."""

    def __init__(self, max_idle_per_host: int = MAX_IDLE_PER_HOST):
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[str, collections.deque[_Connection]] = collections.defaultdict(
            collections.deque
        )
        self.closed = False

    async def request(
        self,
        method: str,
        address: str,
        path: str,
        body: bytes | None = None,
        timeout: float | None = None,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """Send one request to ``address`` (``host:port``); returns ``(status, body)``.

        Raises :class:`HTTPPoolError` (a ``ConnectionError``) when the connection fails
        and ``TimeoutError`` when no full response came within ``timeout`` seconds.
        """
        if self.closed:
            raise HTTPPoolError("the HTTP pool is closed")
        head = f"{method} {path} HTTP/1.1\r\nHost: {address}\r\n"
        for name, value in (headers or {}).items():
            if "\r" in name + value or "\n" in name + value:
                raise ValueError(f"header {name!r} contains a line break")
            head += f"{name}: {value}\r\n"
        if body is not None:
            head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        data = head.encode("latin-1") + b"\r\n" + (body or b"")
        async with asyncio.timeout(timeout):
            connection, reused = self._take(address), True
            if connection is None:
                connection, reused = await self._connect(address), False
            try:
                try:
                    result = await connection.send(data)
                except HTTPPoolError:
                    if not reused or connection.received:
                        raise
                    # the server closed this idle connection: the request never arrived
                    connection.close()
                    connection = await self._connect(address)
                    result = await connection.send(data)
            except BaseException:
                connection.close()  # cancelled, timed out or failed mid-response
                raise
        if connection.finish():
            idle = self._idle[address]
            if len(idle) < self.max_idle_per_host:
                idle.append(connection)
            else:
                connection.close()
        else:
            connection.close()
        return result

    def _take(self, address: str) -> _Connection | None:
        idle = self._idle.get(address)
        while idle:
            connection = idle.pop()  # the most recently used one is the least likely stale
            if connection.usable:
                return connection
            connection.close()
        return None

    async def _connect(self, address: str) -> _Connection:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"address must be host:port, got {address!r}")
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_connection(_Connection, host.strip("[]"), int(port))
        except OSError as e:
            raise HTTPPoolError(f"cannot connect to {address}: {e}") from e
        return connection

    async def close(self) -> None:
        self.closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run their close callbacks
