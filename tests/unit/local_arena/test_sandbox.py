"""The local Arena's shared child-process sandbox, tested directly.

The grader and harness tests cover it through their callers; these pin down the helpers
themselves: the environment, output capture, the socket guard and the group kill.
"""

from __future__ import annotations

import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from examples.swe.local_arena import sandbox


def test_minimal_env_is_path_home_and_lang_only(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2")
    env = sandbox.minimal_env(tmp_path, "/opt/tool", "/usr/bin")
    # "/usr/bin" stays where it first appears, so the system list adds it no second time.
    assert env == {
        "PATH": "/opt/tool:/usr/bin:/usr/local/bin:/bin",
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
    }


def test_capture_keeps_the_head_and_the_tail() -> None:
    capture = sandbox.Capture(head=3, tail=4)
    capture.add(b"abcdef")  # first = "abc", last = "def"
    capture.add(b"ghij")  # last = "defghij", 7 > 4: drop "def"
    assert capture.dropped == 3
    assert capture.text() == "abc\n[... 3 bytes cut ...]\nghij"


def run(tmp_path: Path, argv: list[str], timeout: float = 10) -> tuple[int | None, str]:
    """``run_to_files`` in ``tmp_path``; the exit code and stdout."""
    out = tmp_path / "stdout"
    with out.open("wb") as stdout, (tmp_path / "stderr").open("wb") as stderr:
        code = sandbox.run_to_files(
            argv, sandbox.minimal_env(tmp_path), tmp_path, timeout, stdout=stdout, stderr=stderr
        )
    return code, out.read_text()


def test_the_socket_guard_refuses_connections(tmp_path) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        probe = (
            "import socket\n"
            "for attempt in (\n"
            f"    lambda: socket.create_connection(('127.0.0.1', {port}), timeout=1),\n"
            f"    lambda: socket.socket().connect(('127.0.0.1', {port})),\n"
            "):\n"
            "    try:\n"
            "        attempt()\n"
            "        print('open')\n"
            "    except OSError as e:\n"
            "        print('blocked:', e)\n"
        )
        code, stdout = run(tmp_path, [sys.executable, "-I", "-c", sandbox.SOCKET_GUARD + probe])
    assert code == 0
    assert stdout.splitlines() == 2 * [
        "blocked: network access is disabled in the local Arena sandbox"
    ]


def running(marker: str) -> bool:
    """Whether a live (not zombie) process has ``marker`` as its argv[0]."""
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            cmdline = (status.parent / "cmdline").read_bytes().split(b"\0")[0].decode()
            state = status.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if cmdline == marker and state not in ("Z", "X"):
            return True
    return False


def wait_until_gone(marker: str, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while running(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_timeout_kills_the_whole_group(tmp_path) -> None:
    marker = f"sandbox-test-{uuid.uuid4().hex}"
    script = f"(exec -a {marker} sleep 60) & echo started; wait"
    started = time.monotonic()
    code, stdout = run(tmp_path, ["/bin/bash", "-c", script], timeout=0.5)
    assert code is None and stdout == "started\n"
    assert time.monotonic() - started < 5
    assert wait_until_gone(marker)


def test_background_children_end_with_a_normal_exit(tmp_path) -> None:
    marker = f"sandbox-test-{uuid.uuid4().hex}"
    code, _ = run(tmp_path, ["/bin/bash", "-c", f"(exec -a {marker} sleep 60) & sleep 0.2; exit 3"])
    assert code == 3
    assert wait_until_gone(marker)


@pytest.mark.skipif(not sandbox.unshare_prefix(pid=True), reason="no PID namespace here")
def test_the_pid_namespace_ends_children_that_left_the_group(tmp_path) -> None:
    # setsid puts the sleeper in a session of its own, out of reach of the group kill;
    # only the end of the PID namespace takes it down.
    marker = f"sandbox-test-{uuid.uuid4().hex}"
    script = f"setsid bash -c 'exec -a {marker} sleep 60' & sleep 0.2"
    code, _ = run(tmp_path, [*sandbox.unshare_prefix(pid=True), "/bin/bash", "-c", script])
    assert code == 0
    assert wait_until_gone(marker)
