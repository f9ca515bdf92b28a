"""Proxy hardening against the real process (``python -m areal.proxy.server``).

The proxy is started the way ``RemoteSGLangEngine.launch_proxy`` starts it (admin key in
the environment, the same flags) in front of a stand-in inference server that only
answers ``/health``; none of these requests reaches generation. Memory is read from
``/proc/<pid>/status``; a watchdog kills the proxy if it passes 1 GiB, so a regression
fails the test instead of exhausting the machine (one 100 MB chat request used to take
the proxy to 23.7 GB).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes.live_server import ScriptedASGI, free_port, serve
from tests.fakes.scripted_http import ScriptedHTTP, reply
from tests.unit.proxy.conftest import ADMIN, bearer

REPO_ROOT = Path(__file__).resolve().parents[3]
RSS_LIMIT = 1024**3
MB = 1_000_000


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class Proxy:
    """A running proxy process, with its peak resident memory watched."""

    def __init__(self, process: subprocess.Popen, port: int):
        self.process, self.port = process, port
        self.url = f"http://127.0.0.1:{port}"
        self.peak = 0
        self.killed_for_memory = False
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watchdog, daemon=True)
        self._watch.start()

    def _watchdog(self) -> None:
        while not self._stop.is_set() and self.process.poll() is None:
            try:
                used = rss(self.process.pid)
            except (OSError, RuntimeError):
                return
            self.peak = max(self.peak, used)
            if used > RSS_LIMIT:
                self.killed_for_memory = True
                self.process.kill()
                return
            time.sleep(0.01)

    def rss(self) -> int:
        return rss(self.process.pid)

    def stop(self) -> None:
        self._stop.set()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def engine_addr() -> Iterator[str]:
    stand_in = ScriptedHTTP().on("GET", "/health", reply(200, {"status": "ok"}))
    with serve(ScriptedASGI(stand_in)) as url:
        yield url.removeprefix("http://")


def start_proxy(engine_addr: str, tokenizer_path: Path, *flags: str) -> Proxy:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "areal.proxy.server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--engine-addr",
        engine_addr,
        "--tokenizer-path",
        str(tokenizer_path),
        "--tool-call-parser",
        "qwen25",
        "--reasoning-parser",
        "qwen3",
        "--chat-template-type",
        "hf",
        "--request-timeout",
        "60",
        "--session-timeout",
        "3600",
        *flags,
    ]
    env = {**os.environ, "SWE_RL_ADMIN_API_KEY": ADMIN, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env)
    deadline = time.monotonic() + 180
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the proxy exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return Proxy(process, port)
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError("the proxy did not become healthy")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def proxy(engine_addr, tiny_model_dir) -> Iterator[Proxy]:
    running = start_proxy(
        engine_addr, tiny_model_dir, "--header-timeout", "1", "--max-header-bytes", "8192"
    )
    yield running
    running.stop()


def status_of(answer: bytes) -> int | None:
    if not answer.startswith(b"HTTP/1.1 "):
        return None
    return int(answer[9:12])


def stream_request(port: int, head: bytes, body_chunks: Iterator[bytes], wait: float = 30) -> bytes:
    """Send a request, stopping the body as soon as an answer arrives; return the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(head)
        try:
            for chunk in body_chunks:
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    break
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except (ConnectionResetError, TimeoutError):
            pass
        return answer


def chat_body_chunks(total: int, chunk: int = MB) -> Iterator[bytes]:
    """``total`` bytes of one valid chat request whose single message is ``a`` * n."""
    head = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    yield head
    left = total - len(head) - len(tail)
    while left > 0:
        size = min(chunk, left)
        yield b"a" * size
        left -= size
    yield tail


def chunked(chunks: Iterator[bytes]) -> Iterator[bytes]:
    for chunk in chunks:
        yield b"%x\r\n%s\r\n" % (len(chunk), chunk)
    yield b"0\r\n\r\n"


def head(path: str, key: str, extra: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: proxy\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\n{extra}\r\n"
    ).encode()


def session_key(proxy: Proxy, task_id: str) -> tuple[str, str]:
    admin = bearer(ADMIN)
    httpx.post(f"{proxy.url}/grant_capacity", headers=admin).raise_for_status()
    started = httpx.post(f"{proxy.url}/rl/start_session", headers=admin, json={"task_id": task_id})
    started.raise_for_status()
    return started.json()["session_id"], started.json()["api_key"]


def test_a_100_mb_body_gets_413_and_the_proxy_stays_under_1_gb(proxy):
    _, key = session_key(proxy, "huge")
    total = 100 * MB
    cases = {
        "declared chat": (
            head("/v1/chat/completions", key, f"content-length: {total}\r\n"),
            chat_body_chunks(total),
        ),
        "chunked messages": (
            head("/v1/messages", key, "transfer-encoding: chunked\r\n"),
            chunked(chat_body_chunks(total)),
        ),
        "declared admin": (
            head("/rl/start_session", ADMIN, f"content-length: {total}\r\n"),
            chat_body_chunks(total),
        ),
    }
    for name, (request_head, chunks) in cases.items():
        answer = stream_request(proxy.port, request_head, chunks)
        assert not proxy.killed_for_memory, f"{name}: the proxy passed 1 GiB"
        assert status_of(answer) == 413, (name, answer[:300])
        assert b"--max-body-bytes" in answer and b"16777216" in answer
    assert proxy.peak < RSS_LIMIT and proxy.rss() < RSS_LIMIT
    assert httpx.get(f"{proxy.url}/health").status_code == 200


def test_stalled_or_oversized_headers_are_refused(proxy):
    started = time.monotonic()
    silent = stream_request(proxy.port, b"", iter(()), wait=10)  # connects, sends nothing
    partial = stream_request(
        proxy.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: p\r\n", iter(()), wait=10
    )
    assert status_of(silent) == 408 and status_of(partial) == 408, (silent, partial)
    assert b"--header-timeout" in partial and time.monotonic() - started < 8
    oversized = stream_request(
        proxy.port,
        b"GET /health HTTP/1.1\r\nhost: p\r\nx-padding: " + b"p" * 20_000 + b"\r\n\r\n",
        iter(()),
    )
    assert status_of(oversized) == 431 and b"--max-header-bytes" in oversized
    assert httpx.get(f"{proxy.url}/health").status_code == 200


def test_memory_goes_back_after_a_large_request_and_its_export(proxy):
    session_id, key = session_key(proxy, "large")
    baseline = proxy.rss()
    body = b"".join(chat_body_chunks(3 * MB)).replace(b"a" * 10, b"word word ")
    response = httpx.post(
        f"{proxy.url}/v1/chat/completions",
        headers={**bearer(key), "content-type": "application/json"},
        content=body,
        timeout=300,
    )
    assert response.status_code == 400  # far over the context window
    httpx.post(f"{proxy.url}/rl/end_session", headers=bearer(key)).raise_for_status()
    httpx.post(
        f"{proxy.url}/export_trajectories", headers=bearer(ADMIN), json={"session_id": session_id}
    ).raise_for_status()
    time.sleep(2.5)  # trims run at most once a second, on a worker thread
    after = proxy.rss()
    print(f"baseline {baseline >> 20} MiB, peak {proxy.peak >> 20} MiB, after {after >> 20} MiB")
    assert not proxy.killed_for_memory and after - baseline < 100 * 2**20


def test_an_unended_export_times_out_and_sigterm_still_stops_the_proxy(engine_addr, tiny_model_dir):
    proxy = start_proxy(engine_addr, tiny_model_dir, "--export-timeout", "1")
    try:
        session_id, _ = session_key(proxy, "never-ended")
        export = httpx.post(
            f"{proxy.url}/export_trajectories",
            headers=bearer(ADMIN),
            json={"session_id": session_id},
            timeout=15,
        )
        assert export.status_code == 409 and "--export-timeout" in export.text
        pending = threading.Thread(
            target=lambda: httpx.post(
                f"{proxy.url}/export_trajectories",
                headers=bearer(ADMIN),
                json={"session_id": session_id},
                timeout=15,
            )
        )
        pending.start()
        time.sleep(0.3)
        stopping = time.monotonic()
        proxy.process.send_signal(signal.SIGTERM)
        proxy.process.wait(timeout=15)
        assert time.monotonic() - stopping < 10
        pending.join(timeout=15)
    finally:
        proxy.stop()
