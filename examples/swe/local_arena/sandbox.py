"""Child-process sandbox of the local Arena, shared by the grader and the harnesses.

The ``python_tests`` grader runs a candidate answer, the ``tool_agent`` harness runs the
model's ``run_python`` and ``bash`` calls, and the CLI harnesses run Claude Code and Codex;
all of them start children through this module. What it provides:

* **No network**: :func:`unshare_prefix` is an ``unshare`` command-line prefix for a private
  network namespace (only a downed loopback device), optionally with a PID namespace too,
  when this machine allows unprivileged user namespaces. :data:`SOCKET_GUARD` is Python
  source that makes the ``socket`` module refuse to connect; Python children run it first,
  which is the only network barrier where the namespace is refused.
* **No inherited secrets**: :func:`minimal_env` is a whole environment of PATH, HOME and LANG;
  nothing of this process's environment reaches the child.
* **Bounded time and no leftovers**: children start in their own session; after they exit,
  at their timeout or on cancellation the whole process group is killed, so nothing they
  started in the background outlives them. A :class:`ProcessGroups` made current with
  :func:`owned_by` (the task runner does, per task) also records every group started in
  its context, threads included, so that a stopping server kills them all at once.
* **Bounded output**: :func:`run_captured` keeps only a head and a tail of the output;
  :func:`run_to_files` writes it to files, which the caller's ``RLIMIT_FSIZE`` caps.

What it does not protect against: it stops accidents and casual escapes, not a determined
adversary. The filesystem is shared, so a child reads whatever this user can and may write
outside its working directory. Without the namespace the socket guard is the only barrier,
and ``_socket``, ``ctypes`` or a subprocess step around it; ``bash`` gets no guard at all.
A child that calls ``setsid`` leaves the process group and escapes the kill, unless it runs
in a PID namespace. Resource limits (rlimits) are the caller's to set. Linux only.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import select
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = [
    "SOCKET_GUARD",
    "SYSTEM_PATH",
    "Capture",
    "ProcessGroups",
    "ProcessResult",
    "kill_process_group",
    "minimal_env",
    "owned_by",
    "run_captured",
    "run_to_files",
    "search_path",
    "unshare_prefix",
]

SYSTEM_PATH = ("/usr/local/bin", "/usr/bin", "/bin")
PIPE_GRACE_S = 1.0  # how long output may keep coming once a process has exited
PROBE_TIMEOUT_S = 10.0

# --- isolation: network namespace, socket guard, environment ---


@functools.cache
def unshare_prefix(pid: bool = False) -> tuple[str, ...]:
    """``unshare`` arguments that run a command in a private network namespace, or ``()``
    when this machine does not allow unprivileged namespaces. Probed once per variant.

    ``pid=True`` adds a PID namespace whose init is killed with ``unshare`` itself
    (``--fork --kill-child``), so one kill takes down every process the child forked, even
    those that left its process group."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    namespaces = ("--net", "--pid", "--fork", "--kill-child") if pid else ("--net",)
    prefix = (unshare, *namespaces, "--map-root-user", "--")
    try:
        probe = subprocess.run(
            [*prefix, "/bin/true"],
            env={},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ()
    return prefix if probe.returncode == 0 else ()


# Python source for the start of a sandboxed program. It leaves the names `socket` and
# `_no_network` behind, so callers run the program itself in a fresh namespace.
SOCKET_GUARD = """\
import socket

def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the local Arena sandbox")

for _name in ("connect", "connect_ex", "sendto", "sendmsg"):
    setattr(socket.socket, _name, _no_network)
socket.create_connection = socket.getaddrinfo = _no_network
"""


def search_path(*dirs: str) -> str:
    """A PATH of ``dirs`` followed by the system directories, each directory once."""
    return os.pathsep.join(dict.fromkeys([*dirs, *SYSTEM_PATH]))


def minimal_env(home: Path, *path_dirs: str) -> dict[str, str]:
    """The whole environment of a sandboxed child: PATH (``path_dirs``, then the system
    directories), HOME and LANG. Nothing is inherited, so no secret reaches the child."""
    return {"PATH": search_path(*path_dirs), "HOME": str(home), "LANG": "C.UTF-8"}


def kill_process_group(pid: int) -> None:
    """SIGKILL the process group of ``pid``, a child started in its own session. A group
    that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


# --- ownership: every group a server started, for a prompt stop ---


class ProcessGroups:
    """The process groups started on behalf of one owner (a local Arena's task runner).

    :meth:`kill_all` SIGKILLs every recorded group and closes the set: a child started
    afterwards (a grader thread that was about to spawn) is killed as soon as it starts.
    """

    def __init__(self) -> None:
        self._pids: set[int] = set()
        self._lock = threading.Lock()
        self.closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._pids)

    def add(self, pid: int) -> bool:
        """Record the group of ``pid``; ``False`` (and nothing recorded) once closed."""
        with self._lock:
            if self.closed:
                return False
            self._pids.add(pid)
            return True

    def discard(self, pid: int) -> None:
        with self._lock:
            self._pids.discard(pid)

    def kill_all(self) -> int:
        """Kill every recorded group and refuse new ones; returns how many were killed."""
        with self._lock:
            self.closed = True
            pids, self._pids = list(self._pids), set()
        for pid in pids:
            kill_process_group(pid)
        return len(pids)


_OWNER: contextvars.ContextVar[ProcessGroups | None] = contextvars.ContextVar(
    "local_arena_process_groups", default=None
)


def owned_by(groups: ProcessGroups) -> None:
    """Record the children started from the current context (and contexts copied from it:
    asyncio tasks, ``asyncio.to_thread``) in ``groups``."""
    _OWNER.set(groups)


@contextlib.contextmanager
def _owned(pid: int) -> Iterator[None]:
    """Record ``pid``'s group with the current owner for the block (killed at once if the
    owner has already stopped)."""
    owner = _OWNER.get()
    if owner is not None and not owner.add(pid):
        kill_process_group(pid)
    try:
        yield
    finally:
        if owner is not None:
            owner.discard(pid)


# --- synchronous runner (the grader runs in a worker thread) ---


def _wait_for_exit(process: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether ``process`` exits within ``timeout`` seconds. A pidfd wakes us the moment it
    does; ``Popen.wait(timeout)`` polls with sleeps that add tens of milliseconds a run."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    return bool(ready)


def run_to_files(
    argv: list[str],
    env: dict[str, str],
    cwd: Path,
    timeout: float,
    *,
    stdout: IO[bytes],
    stderr: IO[bytes],
) -> int | None:
    """Run ``argv`` in its own session with stdin closed and its output written to
    ``stdout`` and ``stderr``; the exit code, or None when it ran past ``timeout`` seconds.

    The process group is killed either way, also after a normal exit: whatever the child
    left running in the background. Raises :class:`OSError` when ``argv`` cannot start."""
    process = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )
    with _owned(process.pid):
        code = process.wait() if _wait_for_exit(process, timeout) else None
        kill_process_group(process.pid)
        process.wait()
    return code


# --- asynchronous runner (the harnesses) ---


@dataclass
class Capture:
    """Keeps the first ``head`` and the last ``tail`` bytes of a stream."""

    head: int
    tail: int
    first: bytearray = field(default_factory=bytearray)
    last: bytearray = field(default_factory=bytearray)
    dropped: int = 0

    def add(self, chunk: bytes) -> None:
        room = self.head - len(self.first)
        self.first += chunk[:room]
        self.last += chunk[room:] if room > 0 else chunk
        if len(self.last) > self.tail:
            self.dropped += len(self.last) - self.tail
            del self.last[: len(self.last) - self.tail]

    def text(self) -> str:
        gap = f"\n[... {self.dropped} bytes cut ...]\n" if self.dropped else ""
        return (
            bytes(self.first).decode(errors="replace")
            + gap
            + bytes(self.last).decode(errors="replace")
        )


@dataclass
class ProcessResult:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool


async def run_captured(
    argv: list[str],
    env: dict[str, str],
    cwd: Path,
    timeout: float,
    *,
    tail: int,
    head: int = 0,
    merge: bool = False,
) -> ProcessResult:
    """Run ``argv`` in its own session with stdin closed and keep the first ``head`` and the
    last ``tail`` bytes of its output. ``merge`` sends stderr into stdout.

    When the process exits, after ``timeout`` seconds, or on cancellation the whole group is
    killed, so nothing it started in the background outlives it."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT if merge else asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    out, err = Capture(head, tail), Capture(head, tail)

    async def drain(stream: asyncio.StreamReader | None, capture: Capture) -> None:
        while stream is not None and (chunk := await stream.read(65536)):
            capture.add(chunk)

    drains = asyncio.gather(drain(proc.stdout, out), drain(proc.stderr, err))
    timed_out = False
    with _owned(proc.pid):
        try:
            await asyncio.wait_for(_exited(proc), timeout)
            # Background children may hold the pipes open; they get a moment, then the kill.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(drains), PIPE_GRACE_S)
        except TimeoutError:
            timed_out = True
        finally:
            await _kill_group(proc)
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(drains, PIPE_GRACE_S)
    return ProcessResult(proc.returncode, out.text(), err.text(), timed_out)


async def _exited(proc: asyncio.subprocess.Process) -> None:
    # Not proc.wait(): on Python 3.11 that also waits until every pipe is closed, which a
    # background child can hold off indefinitely.
    while proc.returncode is None:
        await asyncio.sleep(0.02)


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    kill_process_group(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(asyncio.CancelledError, TimeoutError):
        await asyncio.wait_for(_exited(proc), 5)
