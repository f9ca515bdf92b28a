"""Proxy hardening: body-size cap, stalled bodies, and large prompts off the event loop."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from tests.unit.proxy.conftest import ADMIN, ScriptedEngine, bearer, running_proxy, start_session

CAP = 4096


def big_chat(size: int) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "word " * (size // 5)}]}


def raw_exchange(url: str, request: bytes, wait: float = 10.0) -> bytes:
    """Send ``request`` on a fresh connection; everything the proxy answers until it closes."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=wait) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


@pytest.fixture
def capped(tokenizer):
    engine = ScriptedEngine(tokenizer)
    with running_proxy(engine, tokenizer, max_body_bytes=CAP, body_timeout=0.5) as (url, server):
        session_id, key = start_session(url)
        yield url, server.store.get(session_id), key, engine


def test_a_body_over_the_cap_gets_413_naming_the_limit_on_every_endpoint(capped):
    url, session, key, engine = capped
    body = orjson.dumps(big_chat(2 * CAP))
    for path, credential in (
        ("/v1/chat/completions", key),
        ("/chat/completions", key),
        ("/v1/responses", key),
        ("/rl/set_reward", key),
        ("/rl/start_session", ADMIN),
        ("/export_trajectories", ADMIN),
        ("/health", None),
    ):
        headers = {"content-type": "application/json", **(bearer(credential) if credential else {})}
        method = "GET" if path == "/health" else "POST"
        response = httpx.request(method, f"{url}{path}", headers=headers, content=body)
        assert response.status_code == 413, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "request_too_large" and response.json()["limit"] == CAP
        assert str(CAP) in error["message"] and "--max-body-bytes" in error["message"]
    anthropic = httpx.post(f"{url}/v1/messages?beta=true", headers=bearer(key), content=body)
    assert anthropic.status_code == 413 and anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "request_too_large"
    assert not session.system_error and not engine.requests
    ok = httpx.post(
        f"{url}/v1/chat/completions", headers=bearer(key), json={**big_chat(100), "max_tokens": 2}
    )
    assert ok.status_code == 200  # a body under the cap is served


def test_a_body_without_content_length_is_cut_off_at_the_cap(capped):
    url, session, key, engine = capped
    sent = []

    def chunks():
        for _ in range(64):  # 64 KiB in all, never announced
            sent.append(1024)
            yield b"x" * 1024

    response = httpx.post(
        f"{url}/v1/chat/completions",
        headers={**bearer(key), "content-type": "application/json"},
        content=chunks(),
    )
    assert response.status_code == 413 and str(CAP) in response.text
    assert not session.system_error and not engine.requests


def test_a_stalled_body_gets_408_instead_of_holding_the_connection(capped):
    url, session, key, _ = capped
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\nauthorization: Bearer {key}\r\n"
        "content-type: application/json\r\ncontent-length: 200\r\n\r\n"
    ).encode()
    started = time.monotonic()
    answer = raw_exchange(url, head + b'{"model": "m", ')  # then nothing more
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"--body-timeout" in answer and time.monotonic() - started < 5
    assert not session.system_error


def test_a_large_prompt_does_not_stall_other_sessions(tokenizer):
    # ~3 MB of text is ~1.5M tokens: tokenizing it used to hold the event loop (and the
    # GIL) for seconds, so no other session got an answer meanwhile. The context is large
    # enough that the prompt-size bound lets it through to tokenizing.
    options = {"engine_max_tokens": None, "context_length": 200_000}
    with running_proxy(ScriptedEngine(tokenizer), tokenizer, **options) as (url, _):
        _, key = start_session(url, "big")
        _, other = start_session(url, "small")
        small = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        answered: list[float] = []  # when each of the other session's requests got its answer
        done = threading.Event()

        def other_session() -> None:
            with httpx.Client(timeout=60) as client:
                while not done.is_set():
                    reply = client.post(
                        f"{url}/v1/chat/completions", headers=bearer(other), json=small
                    )
                    assert reply.status_code == 200
                    answered.append(time.monotonic())
                    time.sleep(0.02)

        worker = threading.Thread(target=other_session)
        worker.start()
        body = orjson.dumps(big_chat(3_000_000))
        try:
            time.sleep(0.2)
            started = time.monotonic()
            big = httpx.post(
                f"{url}/v1/chat/completions",
                headers={**bearer(key), "content-type": "application/json"},
                content=body,
                timeout=300,
            )
            ended = time.monotonic()
        finally:
            done.set()
            worker.join()
        assert big.status_code == 400 and big.json()["detail"]["type"] == "context_length_exceeded"
        during = [started] + [t for t in answered if started < t < ended] + [ended]
        longest_gap = max(b - a for a, b in itertools.pairwise(during))
        print(
            f"big request {ended - started:.2f} s; longest wait of the other session "
            f"{longest_gap:.2f} s"
        )
        assert longest_gap < max(1.5, (ended - started) / 3)
