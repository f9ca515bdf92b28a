"""Transport limits of the embedded server: body cap, header/body timeouts, deadlines.

The server runs in this process with the same uvicorn protocol and middleware that
``python -m areal.inference.server`` uses, with small limits so each case is quick.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import httpx
import pytest
import uvicorn

from areal.inference.engine import GenerationEngine
from areal.inference.server import create_app, uvicorn_options
from areal.utils.http_limits import HttpLimits
from areal.utils.network import find_free_port

LIMITS = HttpLimits(
    max_body_bytes=1_000_000,
    max_header_bytes=16_384,
    header_timeout=1.0,
    body_timeout=1.0,
    keep_alive_timeout=5.0,
    request_deadline=2.0,
)


@contextmanager
def serve_with_limits(app, limits: HttpLimits) -> Iterator[tuple[str, int]]:
    port = find_free_port("127.0.0.1")
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        **uvicorn_options(limits),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def generation(tiny_model_dir):
    engine = GenerationEngine(str(tiny_model_dir), device="cpu", max_running_requests=8).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def server(generation):
    with serve_with_limits(create_app(generation, limits=LIMITS), LIMITS) as address:
        yield address


def exchange(address: tuple[str, int], data: bytes, wait: float = 10.0) -> tuple[bytes, float]:
    """Send raw bytes; returns the whole answer (b"" if the server just closed) and how
    long it took."""
    with socket.create_connection(address, timeout=wait) as conn:
        started = time.monotonic()
        conn.sendall(data)
        received = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break
            received += chunk
            head, sep, body = received.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                ),
                None,
            )
            if sep and length is not None and len(body) >= length:
                break
        return received, time.monotonic() - started


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def test_a_declared_oversized_body_gets_413_before_it_is_sent(server):
    head = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 50000000\r\n\r\n"
    )
    answer, took = exchange(server, head)  # not one byte of the 50 MB body sent
    assert status(answer) == 413 and took < 1.0


def test_a_streamed_body_over_the_cap_gets_413_once_it_passes(server):
    with socket.create_connection(server, timeout=10) as conn:
        conn.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
        sent, answer = 0, b""
        conn.settimeout(0.05)
        while not answer and sent < 3 * LIMITS.max_body_bytes:
            conn.sendall(chunk)
            sent += 65536
            with suppress(TimeoutError):
                answer = conn.recv(65536)
    assert status(answer) == 413
    assert LIMITS.max_body_bytes < sent < 2 * LIMITS.max_body_bytes  # answered near the cap


def test_slow_headers_get_408_and_a_silent_connection_is_closed(server):
    answer, took = exchange(server, b"POST /generate HTTP/1.1\r\nHost: x\r\n")
    assert status(answer) == 408 and LIMITS.header_timeout <= took < 4 * LIMITS.header_timeout
    answer, took = exchange(server, b"")
    assert answer == b"" and took < 4 * LIMITS.header_timeout


def test_oversized_headers_get_431(server):
    answer, _ = exchange(server, b"GET /health HTTP/1.1\r\nX-Pad: " + b"a" * 40_000)
    assert status(answer) == 431


def test_a_body_that_does_not_arrive_gets_408(server):
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\n"
    answer, took = exchange(server, head + b'{"input_i')
    assert status(answer) == 408 and b"did not arrive" in answer
    assert LIMITS.body_timeout <= took < 4 * LIMITS.body_timeout


def test_a_request_past_its_deadline_gets_504_and_is_not_generated(server, generation):
    base = f"http://{server[0]}:{server[1]}"
    generation.command("pause", mode="in_place").result(timeout=30)
    try:
        before = generation.stats["generated_tokens"]
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 64}}
        started = time.monotonic()
        response = httpx.post(f"{base}/generate", json=body, timeout=30)
        assert response.status_code == 504, response.text
        assert LIMITS.request_deadline <= time.monotonic() - started < 3 * LIMITS.request_deadline
    finally:
        generation.command("continue").result(timeout=30)
    # A fence: requests are admitted in arrival order, and each admitted one gets its first
    # token at once, so when this one-token request is answered the late one, had it not
    # been dropped, would have at least one token counted too.
    one = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(f"{base}/generate", json=one, timeout=30).status_code == 200
    assert generation.stats["generated_tokens"] == before + 1  # the fence's: dropped, never decoded


def test_a_slow_large_upload_does_not_hold_other_requests(server):
    base = f"http://{server[0]}:{server[1]}"
    size = 900_000  # under the cap, sent over ~0.8 s
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    head += b"content-length: %d\r\n\r\n" % size
    tail = b'1], "sampling_params": {"max_new_tokens": 1}}'
    payload = b'{"input_ids": [' + b" " * (size - 15 - len(tail)) + tail
    assert len(payload) == size
    latencies = []

    def upload() -> None:
        with socket.create_connection(server, timeout=30) as conn:
            conn.sendall(head)
            for start in range(0, size, 45_000):
                conn.sendall(payload[start : start + 45_000])
                time.sleep(0.04)
            conn.recv(65536)

    uploader = threading.Thread(target=upload)
    uploader.start()
    time.sleep(0.1)
    with httpx.Client(timeout=10) as http:
        while uploader.is_alive():
            started = time.monotonic()
            ok = http.post(
                f"{base}/generate",
                json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}},
            )
            assert ok.status_code == 200
            latencies.append(time.monotonic() - started)
    uploader.join()
    # a held server answers once, after the upload (~0.8 s); a free one answers many times
    # meanwhile. The median, not the max: one answer may meet a GC pause on a busy machine.
    assert len(latencies) >= 3, latencies
    assert sorted(latencies)[len(latencies) // 2] < 0.5, latencies
