"""The keep-alive HTTP client: reuse, framing, stale connections, timeouts, bad peers."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from areal.utils.http_pool import HTTPPool, HTTPPoolError


class RawServer:
    """A TCP server whose replies are scripted per request (bytes or a callable)."""

    def __init__(self, reply):
        self.reply = reply
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        for writer in self.writers:
            writer.close()
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                reply = self.reply(len(self.requests), head + body)
                if reply is None:  # close without answering
                    writer.close()
                    return
                writer.write(reply)
                await writer.drain()
                if b"connection: close" in reply.lower():
                    writer.close()
                    return


def sized(body: bytes, status: str = "200 OK", extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


@pytest.mark.asyncio
async def test_connections_are_reused_and_requests_are_well_formed():
    server = RawServer(lambda n, _: sized(b'{"n": %d}' % n))
    async with server as address:
        pool = HTTPPool()
        for i in range(1, 6):
            status, body = await pool.request(
                "POST", address, "/generate", b'{"x": 1}', 5, headers={"Authorization": "Bearer k"}
            )
            assert (status, body) == (200, b'{"n": %d}' % i)
        await pool.close()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /generate HTTP/1.1\r\n")
    assert b"\r\nContent-Length: 8\r\n" in first and b"\r\nAuthorization: Bearer k\r\n" in first
    assert first.endswith(b'\r\n\r\n{"x": 1}')


@pytest.mark.asyncio
async def test_concurrent_requests_each_get_their_own_answer():
    server = RawServer(lambda n, raw: sized(raw.rsplit(b"\r\n\r\n", 1)[1]))
    async with server as address:
        pool = HTTPPool()
        bodies = [b'{"i": %d}' % i for i in range(40)]
        results = await asyncio.gather(
            *(pool.request("POST", address, "/echo", b, 5) for b in bodies)
        )
        assert [body for _, body in results] == bodies
        # a second wave reuses the idle connections of the first
        await asyncio.gather(*(pool.request("POST", address, "/echo", b, 5) for b in bodies))
        await pool.close()
    assert server.connections == 40


@pytest.mark.asyncio
async def test_chunked_and_close_delimited_bodies():
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    until_close = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nstreamed to the end"
    replies = {1: chunked, 2: until_close, 3: sized(b"after", extra="Connection: close\r\n")}
    server = RawServer(lambda n, _: replies[n])
    async with server as address:
        pool = HTTPPool()
        assert await pool.request("GET", address, "/a", None, 5) == (200, b"hello world")
        assert await pool.request("GET", address, "/b", None, 5) == (200, b"streamed to the end")
        assert await pool.request("GET", address, "/c", None, 5) == (200, b"after")
        await pool.close()
    assert server.connections == 2  # the chunked reply kept its connection; the others closed


@pytest.mark.asyncio
async def test_error_statuses_are_returned_not_raised():
    server = RawServer(lambda n, _: sized(b'{"error": "bad"}', "400 Bad Request"))
    async with server as address:
        pool = HTTPPool()
        assert await pool.request("POST", address, "/x", b"{}", 5) == (400, b'{"error": "bad"}')
        await pool.close()


@pytest.mark.asyncio
async def test_a_connection_the_server_closed_while_idle_is_retried_once():
    server = RawServer(lambda n, _: sized(b"ok"))
    async with server as address:
        pool = HTTPPool()
        assert (await pool.request("GET", address, "/1", None, 5))[1] == b"ok"
        for writer in server.writers:  # the server drops the idle keep-alive connection
            writer.close()
        await asyncio.sleep(0.05)
        assert (await pool.request("GET", address, "/2", None, 5))[1] == b"ok"
        await pool.close()
    assert server.connections == 2


@pytest.mark.asyncio
async def test_a_peer_that_hangs_up_mid_request_fails_clearly():
    server = RawServer(lambda n, _: None)
    async with server as address:
        pool = HTTPPool()
        with pytest.raises(HTTPPoolError, match="connection closed before the response ended"):
            await pool.request("POST", address, "/x", b"{}", 5)
        await pool.close()


@pytest.mark.asyncio
async def test_timeouts_and_refused_connections_and_garbage():
    async def never(reader, writer):
        await asyncio.sleep(10)

    slow = await asyncio.start_server(never, "127.0.0.1", 0)
    port = slow.sockets[0].getsockname()[1]
    pool = HTTPPool()
    with pytest.raises(TimeoutError):
        await pool.request("GET", f"127.0.0.1:{port}", "/", None, 0.2)
    slow.close()
    await slow.wait_closed()
    with pytest.raises(HTTPPoolError, match="cannot connect"):
        await pool.request("GET", f"127.0.0.1:{port}", "/", None, 2)

    server = RawServer(lambda n, _: b"this is not HTTP\r\n\r\n")
    async with server as garbage:
        with pytest.raises(HTTPPoolError, match="malformed HTTP response"):
            await pool.request("GET", garbage, "/", None, 2)
    await pool.close()


@pytest.mark.asyncio
async def test_bad_arguments_are_refused():
    pool = HTTPPool()
    with pytest.raises(ValueError, match="host:port"):
        await pool.request("GET", "no-port", "/", None, 1)
    with pytest.raises(ValueError, match="line break"):
        await pool.request("GET", "127.0.0.1:1", "/", None, 1, headers={"X": "a\r\nEvil: 1"})
    await pool.close()
    with pytest.raises(HTTPPoolError, match="closed"):
        await pool.request("GET", "127.0.0.1:1", "/", None, 1)
