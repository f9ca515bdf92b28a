"""The local Arena stops promptly and cannot be held: SIGTERM, child processes, slow headers.

The process tests run the real ``python -m examples.swe.local_arena serve``. The wedge they
guard against: a grader program that runs for minutes in a worker thread kept the process
alive after SIGTERM until the grader's own timeout, whatever uvicorn did.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from areal.utils.network import find_free_port, wait_healthy
from areal.utils.serving import serve_in_thread
from examples.swe.local_arena import sandbox
from tests.fakes.stub_llm import StubLLM

REPO = Path(__file__).resolve().parents[3]
SLOW_ANSWER = "```python\nimport time\ntime.sleep(120)\n\ndef one():\n    return 1\n```"
CATALOG = """\
streams:
  - {stream_id: slow-py, default_harness: answer-chat@1.0.0, default_reward: slow-tests@1.0.0,
     dataset: one}
harnesses:
  - {key: answer-chat, version: 1.0.0, protocol: chat_completions, kind: answer}
rewards:
  - {key: slow-tests, version: 1.0.0, grader: python_tests, options: {timeout: 120}}
datasets:
  one:
    rows:
      - {data_id: q1, prompt: "Write one().", grading: {tests: "assert one() == 1"}}
"""


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def start_server(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str, str]:
    port = find_free_port("127.0.0.1")
    argv = [sys.executable, "-m", "examples.swe.local_arena", "serve", "--port", str(port)]
    argv += ["--db", str(tmp_path / "arena.db"), "--log-level", "warning", *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(argv, cwd=REPO, env=env)
    try:
        wait_healthy(f"127.0.0.1:{port}", process, timeout=60, what="local Arena")
    except BaseException:
        process.kill()
        process.wait()
        raise
    token = (tmp_path / "arena.db.token").read_text().strip()
    return process, f"http://127.0.0.1:{port}", token


# --- the registry of child process groups ---


async def test_killing_the_groups_stops_children_started_from_threads(tmp_path):
    groups = sandbox.ProcessGroups()

    def slow_child() -> int | None:
        with open(os.devnull, "wb") as out:
            argv = [sys.executable, "-c", "import time; time.sleep(60)"]
            return sandbox.run_to_files(argv, {}, tmp_path, 60.0, stdout=out, stderr=out)

    async def owned_run():
        sandbox.owned_by(groups)
        return await asyncio.to_thread(slow_child)

    run = asyncio.create_task(owned_run())
    await asyncio.to_thread(wait_until, lambda: len(groups) == 1, "the child to start")
    started = time.monotonic()
    assert groups.kill_all() == 1
    assert await asyncio.wait_for(run, 10) == -signal.SIGKILL
    assert time.monotonic() - started < 5
    # closed: a child started afterwards is killed at once
    sandbox.owned_by(groups)
    assert await asyncio.wait_for(asyncio.to_thread(slow_child), 10) == -signal.SIGKILL


# --- real processes ---


@pytest.mark.parametrize("holding", ["grader", "upstream"])
def test_sigterm_exits_promptly_with_a_delayed_request_and_a_task_in_flight(tmp_path, holding):
    """``grader``: the task's grader program sleeps in a worker thread; ``upstream``: its
    harness waits on a gateway call whose upstream never answers. Either way, and with a
    request inside an injected minute of latency, the server is gone within seconds, its
    children with it, and the task is recorded as interrupted, not as a harness failure."""
    (tmp_path / "catalog.yaml").write_text(CATALOG)
    stub = StubLLM(lambda body: SLOW_ANSWER, delay=120.0 if holding == "upstream" else 0.0)
    with serve_in_thread(stub.app()) as upstream:
        server, base, token = start_server(tmp_path, "--catalog", str(tmp_path / "catalog.yaml"))
        headers = {"Authorization": f"Bearer {token}"}
        try:
            endpoint = {"endpoint_id": "e", "upstream_model": "m", "base_url": upstream}
            route = {"model_name": "stream-areal-slow", "endpoints": [{**endpoint, "api_key": "k"}]}
            httpx.post(f"{base}/openapi/v1/llm/models", headers=headers, json=route)
            body = {
                "data_id": "q1",
                "model_name": "stream-areal-slow",
                "base_url": f"{base}/api",
                "api_key": token,
            }
            launched = httpx.post(
                f"{base}/openapi/v1/streams/slow-py/launch_one_task", headers=headers, json=body
            )
            assert launched.status_code == 202, launched.text
            if holding == "grader":
                wait_until(lambda: stub.calls and descendants(server.pid), "the grader to start")
            else:
                wait_until(lambda: stub.calls, "the harness call to reach the upstream")
            children = descendants(server.pid)
            faults = httpx.put(
                f"{base}/openapi/v1/local/faults", headers=headers, json={"latency_ms": 60_000}
            )
            assert faults.status_code == 200

            delayed: list[object] = []

            def delayed_request() -> None:
                try:
                    url = f"{base}/openapi/v1/streams"
                    delayed.append(httpx.get(url, headers=headers, timeout=60).status_code)
                except httpx.HTTPError as e:
                    delayed.append(type(e).__name__)

            thread = threading.Thread(target=delayed_request, daemon=True)
            thread.start()
            time.sleep(0.5)  # the request is now inside its injected minute
            started = time.monotonic()
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=10)
            assert time.monotonic() - started < 4  # uvicorn's graceful wait alone is 5 s
            thread.join(timeout=5)
            assert delayed == [503]
            wait_until(lambda: not any(alive(pid) for pid in children), "the children to die", 5)
        finally:
            stub.delay = 0.0  # releases the held upstream call, so the stub stops at once
            if server.poll() is None:
                server.kill()
                server.wait()
    with sqlite3.connect(tmp_path / "arena.db") as db:
        ((status, raw),) = db.execute("SELECT status, raw FROM tasks").fetchall()
    assert status == "SETUP_FAILED" and "stopped" in json.loads(raw)["error"]


def test_connections_with_unfinished_headers_are_closed(tmp_path):
    server, base, _ = start_server(tmp_path, "--header-timeout", "1")
    try:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: local\r\n")  # never finished
            started = time.monotonic()
            assert slow.recv(1024) == b""  # closed by the server
            assert 0.5 < time.monotonic() - started < 5
        # a client that finishes its headers in time is served, also on a kept-alive connection
        with httpx.Client() as client:
            for _ in range(2):
                assert client.get(f"{base}/health").status_code == 200
                time.sleep(1.5)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["--header-timeout", "0"], "--header-timeout must be in (0, 300] seconds"),
        (["--max-body-bytes", "10"], "(--max-body-bytes) must be an integer in [1024, "),
    ],
)
def test_limit_flags_are_checked(tmp_path, flag, message):
    argv = [sys.executable, "-m", "examples.swe.local_arena", "serve", "--port", "0"]
    argv += ["--db", str(tmp_path / "a.db"), *flag]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=20)
    assert done.returncode == 2 and message in done.stderr
