"""A request body cannot hold a connection of the real local Arena process.

Two ways a client trickling a body used to keep a connection open for as long as it
liked: a body read by a route had no gap timeout, and a body the server never read (the
token check answers 401 before any body byte is read) was dropped as it came while each
byte put off the keep-alive timeout again.
"""

from __future__ import annotations

import signal
import socket
import time

import httpx

from areal.utils.http_limits import _LingeringTransport
from tests.unit.local_arena.test_server_stop import start_server

FAULTS = "/openapi/v1/local/faults"  # reads its body at once: no injected delay


def request_head(method: str, path: str, length: int, token: str | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: local\r\nContent-Length: {length}\r\n"
    if token is not None:
        head += f"Authorization: Bearer {token}\r\n"
    return (head + "\r\n").encode()


def address(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def stop(server) -> None:
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=30)


def test_a_body_that_stalls_gets_408_and_a_whole_one_is_served(tmp_path):
    server, base, token = start_server(tmp_path, "--body-timeout", "1")
    try:
        with socket.create_connection(address(base), timeout=10) as slow:
            slow.sendall(request_head("PUT", FAULTS, 100, token))
            for part in (b"{", b" ", b" "):  # 0.4 s apart: within the 1 s gap, accepted
                slow.sendall(part)
                time.sleep(0.4)
            last_part = time.monotonic() - 0.4
            answer = b""
            while chunk := slow.recv(65536):
                answer += chunk
            took = time.monotonic() - last_part
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b"no part of it for 1 s (--body-timeout)" in answer
        assert 1.0 <= took < 4.0
        # a client that sends its body in time is served, on a kept-alive connection too
        with httpx.Client(headers={"Authorization": f"Bearer {token}"}) as client:
            for _ in range(2):
                assert client.put(f"{base}{FAULTS}", json={}).status_code == 200
    finally:
        stop(server)


def test_a_body_answered_unread_ends_the_connection(tmp_path):
    server, base, _ = start_server(tmp_path)  # the default 60 s body gap never comes into it
    try:
        with socket.create_connection(address(base), timeout=10) as trickle:
            trickle.sendall(request_head("POST", "/openapi/v1/llm/models", 10_000) + b"{")
            trickle.settimeout(0.2)  # then a byte every 0.2 s, without a token: 401 at once
            answer, finished, closed = b"", None, None
            started = time.monotonic()
            while closed is None and time.monotonic() - started < 10:
                try:
                    trickle.sendall(b" ")
                    chunk = trickle.recv(65536)
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    closed = time.monotonic() - started
                    break
                answer += chunk
                if not chunk:  # the answer, then the server's FIN
                    finished = finished or time.monotonic() - started
                    time.sleep(0.2)
        assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
        assert finished is not None and finished < 1.0, answer
        # what still comes is dropped for a moment (the client reads its 401), then closed
        assert closed is not None and closed < _LingeringTransport.LINGER_S + 1.5
        with httpx.Client() as client:
            assert client.get(f"{base}/health").status_code == 200
    finally:
        stop(server)
