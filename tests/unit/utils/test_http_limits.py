"""The shared HTTP request limits: body cap, body gap, deadline, header limits, flags.

The middleware cases drive :class:`BodyLimitMiddleware` directly with scripted ASGI
messages; the protocol cases run a real uvicorn server in a thread and talk raw HTTP to it.
"""

from __future__ import annotations

import argparse
import asyncio
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest
import uvicorn

from areal.utils.http_limits import (
    BodyLimitMiddleware,
    HttpLimits,
    LimitFlags,
    Refusal,
    _LingeringTransport,
    read_body,
    uvicorn_settings,
)
from areal.utils.network import find_free_port

LINGER_S = _LingeringTransport.LINGER_S

# --- small ASGI apps and a scripted client ---


async def echo_app(scope: dict, receive: Any, send: Any) -> None:
    """Answers 200 with the whole body; says nothing when the body never comes."""
    body = await read_body(receive)
    if body is None:
        await send({"type": "http.response.start", "status": 499, "headers": []})
        await send({"type": "http.response.body", "body": b"gone"})
        return
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def http_scope(headers: dict[str, str] | None = None, path: str = "/echo") -> dict[str, Any]:
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return {"type": "http", "method": "POST", "path": path, "headers": raw}


def exchange(
    app: Any, scope: dict, parts: list[tuple[float, bytes]], stall: bool = False
) -> list[dict]:
    """Run ``app`` once: each part of the body comes after its delay (then, with ``stall``,
    nothing more ever); returns what the app sent."""
    sent: list[dict] = []

    async def run() -> None:
        queue = list(parts)

        async def receive() -> dict:
            if not queue:
                await asyncio.sleep(3600 if stall else 0)
                return {"type": "http.disconnect"}
            delay, chunk = queue.pop(0)
            await asyncio.sleep(delay)
            return {"type": "http.request", "body": chunk, "more_body": bool(queue) or stall}

        async def send(message: dict) -> None:
            sent.append(message)

        await app(scope, receive, send)

    asyncio.run(run())
    return sent


def answer(sent: list[dict]) -> tuple[int, dict[bytes, bytes], bytes]:
    start, body = sent[0], sent[1]
    assert len(sent) == 2 and start["type"] == "http.response.start", sent
    return start["status"], dict(start["headers"]), body["body"]


# --- the body cap, the body gap, the deadline ---


def test_a_declared_body_over_the_cap_gets_413_before_the_app_runs():
    called = []

    async def app(scope, receive, send):
        called.append(scope)

    limited = BodyLimitMiddleware(app, HttpLimits(max_body_bytes=100))
    status, headers, body = answer(exchange(limited, http_scope({"content-length": "101"}), []))
    assert status == 413 and not called
    assert headers[b"connection"] == b"close"  # the unread rest of the body ends the connection
    error = orjson.loads(body)["error"]
    assert error["type"] == "request_too_large"
    assert "(101 bytes)" in error["message"] and "limit of 100 bytes" in error["message"]
    assert "--max-body-bytes" in error["message"]  # names what changes the limit
    assert int(headers[b"content-length"]) == len(body)


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_cap():
    limited = BodyLimitMiddleware(echo_app, HttpLimits(max_body_bytes=100))
    parts = [(0, b"x" * 60), (0, b"x" * 60), (0, b"x" * 60)]  # 60, 120 (over), never read
    status, _, body = answer(exchange(limited, http_scope(), parts))
    # the app read a disconnect and answered 499: that is dropped, the 413 went out
    assert status == 413 and b"at least 120 bytes" in body
    ok = BodyLimitMiddleware(echo_app, HttpLimits(max_body_bytes=120))
    assert answer(exchange(ok, http_scope(), parts[:2]))[:1] == (200,)  # 120 is at the cap


def test_a_stalled_body_gets_408_but_a_slow_steady_one_is_served():
    limits = HttpLimits(body_timeout=0.2)
    started = time.monotonic()
    sent = exchange(BodyLimitMiddleware(echo_app, limits), http_scope(), [(0, b"ab")], stall=True)
    status, headers, body = answer(sent)
    assert status == 408 and headers[b"connection"] == b"close"
    assert b"no part of it for 0.2 s" in body and b"--body-timeout" in body
    assert 0.2 <= time.monotonic() - started < 1.5
    # the timeout is a gap between parts: 5 parts 0.1 s apart take 0.5 s in all, and pass
    steady = [(0.1, b"p")] * 5
    status, _, body = answer(exchange(BodyLimitMiddleware(echo_app, limits), http_scope(), steady))
    assert (status, body) == (200, b"ppppp")


def test_an_unanswered_request_gets_504_at_its_deadline():
    async def slow(scope, receive, send):
        await asyncio.sleep(3600)

    limited = BodyLimitMiddleware(slow, HttpLimits(request_deadline=0.2))
    status, headers, body = answer(exchange(limited, http_scope(), []))
    assert status == 504 and b"connection" not in headers  # the body was not the problem
    assert orjson.loads(body)["error"]["type"] == "request_deadline_exceeded"


def test_an_app_error_is_not_swallowed_when_no_limit_refused_the_request():
    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        exchange(BodyLimitMiddleware(broken, HttpLimits(max_body_bytes=10)), http_scope(), [])


def test_the_error_shape_hook_gets_the_refusal_and_the_scope():
    seen: list[tuple[Refusal, dict | None]] = []

    def shape(refusal: Refusal, scope: dict | None) -> tuple[list, bytes]:
        seen.append((refusal, scope))
        anthropic = scope is not None and scope["path"] == "/v1/messages"
        body = {"type": "error", "error": {"message": refusal.message}} if anthropic else {}
        return [(b"content-type", b"application/json")], orjson.dumps(body)

    limits = HttpLimits(max_body_bytes=10, changed_by={"max_body_bytes": "rollout.agent.x"})
    limited = BodyLimitMiddleware(echo_app, limits, shape)
    scope = http_scope({"content-length": "11"}, path="/v1/messages")
    status, headers, body = answer(exchange(limited, scope, []))
    ((refusal, given),) = seen
    assert (refusal.status, refusal.kind, refusal.limit) == (413, "request_too_large", 10)
    assert given is scope and status == 413
    assert orjson.loads(body)["type"] == "error" and "(rollout.agent.x)" in refusal.message
    assert headers[b"content-type"] == b"application/json"


# --- the header limits, on a real server ---


@contextmanager
def serving(limits: HttpLimits, app: Any = echo_app, **protocol: Any) -> Iterator[tuple[str, int]]:
    address = ("127.0.0.1", find_free_port("127.0.0.1"))
    app = BodyLimitMiddleware(app, limits)
    config = uvicorn.Config(
        app,
        host=address[0],
        port=address[1],
        log_level="critical",
        lifespan="off",
        **uvicorn_settings(limits, **protocol),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    try:
        yield address
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def raw(address: tuple[str, int], data: bytes, wait: float = 5.0) -> tuple[bytes, float]:
    """Send ``data``; everything the server answers until it closes, and how long that took."""
    with socket.create_connection(address, timeout=wait) as conn:
        started = time.monotonic()
        conn.sendall(data)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
        return received, time.monotonic() - started


LIMITS = HttpLimits(max_body_bytes=1000, header_timeout=0.5, max_header_bytes=2048)


def test_headers_over_the_cap_get_431_whether_finished_or_not():
    with serving(LIMITS) as address:
        finished, _ = raw(address, b"GET / HTTP/1.1\r\nx-pad: " + b"p" * 3000 + b"\r\n\r\n")
        open_ended, _ = raw(address, b"GET / HTTP/1.1\r\nx-pad: " + b"p" * 3000)
        small, _ = raw(
            address, b"POST / HTTP/1.1\r\nconnection: close\r\ncontent-length: 2\r\n\r\nhi"
        )
    for refused in (finished, open_ended):
        assert refused.startswith(b"HTTP/1.1 431 "), refused[:100]
        assert b"over 2048 bytes (--max-header-bytes)" in refused
        assert b"connection: close" in refused
    assert small.startswith(b"HTTP/1.1 200") and small.endswith(b"\r\n\r\nhi")


def test_the_status_for_headers_over_the_cap_can_be_400():
    with serving(LIMITS, header_limit_status=400) as address:
        refused, _ = raw(address, b"GET / HTTP/1.1\r\nx-pad: " + b"p" * 3000 + b"\r\n\r\n")
    assert refused.startswith(b"HTTP/1.1 400 ")


@pytest.mark.parametrize(
    ("reply", "silent_gets", "partial_gets"),
    [("always", 408, 408), ("after_first_byte", None, 408), ("never", None, None)],
)
def test_late_headers_get_408_or_a_silent_close(reply, silent_gets, partial_gets):
    with serving(LIMITS, header_timeout_reply=reply) as address:
        silent, _ = raw(address, b"")
        partial, took = raw(address, b"POST / HTTP/1.1\r\nhost: x\r\n")
    for got, expected in ((silent, silent_gets), (partial, partial_gets)):
        if expected is None:
            assert got == b""
        else:
            assert got.startswith(b"HTTP/1.1 408 ") and b"(--header-timeout)" in got
    assert 0.5 <= took < 2.5


def test_a_kept_alive_connection_gets_a_fresh_header_deadline_per_request():
    request = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nok"
    with serving(LIMITS) as address, socket.create_connection(address, timeout=5) as conn:
        for _ in range(3):  # each request comes 0.3 s after the last: 0.9 s > the 0.5 s deadline
            time.sleep(0.3)
            conn.sendall(request)
            received = b""
            while not received.endswith(b"\r\n\r\nok"):
                chunk = conn.recv(65536)
                assert chunk, received  # closed before the answer was whole
                received += chunk
            assert received.startswith(b"HTTP/1.1 200")


def test_a_client_still_sending_an_oversized_body_reads_its_413():
    # the server closes with the body unread: without the lingering close the kernel's
    # reset could destroy the 413 before the client reads it
    head = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 50000000\r\n\r\n"
    with serving(LIMITS) as address, socket.create_connection(address, timeout=5) as conn:
        conn.sendall(head)
        sent = 0
        try:
            while sent < 50_000_000 and not select.select([conn], [], [], 0)[0]:
                conn.sendall(b"b" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 413 ") and b"(50000000 bytes)" in received


async def refusing_app(scope: dict, receive: Any, send: Any) -> None:
    """Answers 401 at once without reading the body, as an auth check does."""
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": b"no"})


def test_a_body_left_unread_ends_the_connection_after_the_answer():
    # uvicorn drops the unread rest of a body as it comes, and each byte of it used to put
    # off the keep-alive timeout: a trickle held the connection forever
    limits = HttpLimits(body_timeout=0.5, header_timeout=0.5, keep_alive_timeout=0.5)
    head = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n"
    with serving(limits, refusing_app) as address, socket.create_connection(address) as conn:
        conn.sendall(head + b"x")
        conn.settimeout(0.2)  # a byte every 0.2 s: faster than every timeout above
        received, finished, closed = b"", None, None
        started = time.monotonic()
        while closed is None and time.monotonic() - started < 8:
            try:
                conn.sendall(b"x")
                chunk = conn.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = time.monotonic() - started  # closed for good: the reset of a send
                break
            received += chunk
            if not chunk:  # the answer, then the server's FIN
                finished = finished or time.monotonic() - started
                time.sleep(0.2)
    assert received.startswith(b"HTTP/1.1 401 ") and received.endswith(b"\r\n\r\nno")
    assert finished is not None and finished < 1.0, received
    # the server drops what still comes for a moment, so the client can read the answer
    assert closed is not None and closed < LINGER_S + 1.5
    # with no body left unread, the same answer keeps the connection for the next request
    with serving(limits, refusing_app) as address, socket.create_connection(address) as conn:
        conn.settimeout(5)
        for _ in range(2):
            conn.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            received = b""
            while not received.endswith(b"\r\n\r\nno"):
                chunk = conn.recv(65536)
                assert chunk, received
                received += chunk
            assert received.startswith(b"HTTP/1.1 401 ") and b"connection: close" not in received


def test_an_answer_before_the_body_arrived_says_the_connection_closes():
    # Closing after an answer that went out as a keep-alive one races the client, which
    # may already be sending its next request on the connection ("Server disconnected
    # without sending a response"): the answer itself must say connection: close.
    limits = HttpLimits(body_timeout=5.0, header_timeout=5.0, keep_alive_timeout=5)
    head = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\n"
    with serving(limits, refusing_app) as address, socket.create_connection(address) as conn:
        conn.settimeout(5)
        conn.sendall(head)  # the body comes only after the answer
        received = b""
        while not received.endswith(b"\r\n\r\nno"):
            chunk = conn.recv(65536)
            assert chunk, received
            received += chunk
        conn.sendall(b"body")
    assert received.startswith(b"HTTP/1.1 401 ") and b"connection: close\r\n" in received
    # a body that arrived whole before the answer keeps the connection
    with serving(limits, refusing_app) as address, socket.create_connection(address) as conn:
        conn.settimeout(5)
        for _ in range(2):
            conn.sendall(head + b"body")
            received = b""
            while not received.endswith(b"\r\n\r\nno"):
                chunk = conn.recv(65536)
                assert chunk, received
                received += chunk
            assert b"connection: close" not in received


# --- flags ---


def test_limit_flags_give_each_server_its_defaults_and_name_a_bad_flag(monkeypatch, capsys):
    defaults = HttpLimits(max_body_bytes=4096, header_timeout=15.0, keep_alive_timeout=30)
    flags = LimitFlags(
        defaults,
        ("--max-body-bytes", "--header-timeout", "--idle-timeout", "--request-deadline"),
        env={"--max-body-bytes": "TEST_MAX_BODY"},
    )
    parser = argparse.ArgumentParser(prog="server")
    flags.add_arguments(parser)
    monkeypatch.delenv("TEST_MAX_BODY", raising=False)
    assert flags.parse(parser, parser.parse_args([])) == defaults  # deadline 0: none
    monkeypatch.setenv("TEST_MAX_BODY", "8192")
    parsed = flags.parse(parser, parser.parse_args(["--idle-timeout", "7"]))
    assert (parsed.max_body_bytes, parsed.keep_alive_timeout) == (8192, 7)
    given = parser.parse_args(["--max-body-bytes", "100", "--request-deadline", "2.5"])
    assert flags.parse(parser, given).max_body_bytes == 100  # the flag wins over $TEST_MAX_BODY
    assert flags.parse(parser, given).request_deadline == 2.5
    for argv, named in (
        (["--header-timeout", "0"], "--header-timeout must be positive, got 0.0"),
        (["--request-deadline", "-1"], "--request-deadline must be positive (or 0 for none)"),
    ):
        with pytest.raises(SystemExit):
            flags.parse(parser, parser.parse_args(argv))
        assert named in capsys.readouterr().err
    monkeypatch.setenv("TEST_MAX_BODY", "lots")
    with pytest.raises(SystemExit):
        flags.parse(parser, parser.parse_args([]))
    assert "$TEST_MAX_BODY='lots' is not an integer" in capsys.readouterr().err


def test_limits_refuse_bad_values_naming_the_flag():
    with pytest.raises(ValueError, match=r"max_body_bytes \(--max-body-bytes\) must be at least"):
        HttpLimits(max_body_bytes=0)
    with pytest.raises(ValueError, match=r"body_timeout \(--body-timeout\) must be positive"):
        HttpLimits(body_timeout=float("nan"))
    with pytest.raises(ValueError, match="no such limit flags"):
        LimitFlags(HttpLimits(), ("--max-body-size",))
