"""Child processes of schedulers and workers: logged spawning, liveness, tree killing.

Every child starts in its own session (so it is the leader of a fresh process group)
and its combined output is appended to ``{role}.log`` and, prefixed with a label, to
``merged.log`` in the trial's log directory. Killing collects the whole process tree
first, because descendants that outlive their parent are re-parented and lost.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from areal.utils.lifeline import child_env

__all__ = [
    "LoggedProcess",
    "descendant_pids",
    "kill_process_tree",
    "kill_process_trees",
    "process_alive",
    "read_log_tail",
]

TAIL_LINES = 50


class LoggedProcess:
    """A child process whose output a background thread tees into the trial's logs.

    ``label`` prefixes each line in ``merged.log`` (``[label] ...``); the last
    :data:`TAIL_LINES` lines are kept in memory for error messages.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        log_dir: str | os.PathLike[str],
        role: str,
        label: str | None = None,
        cwd: str | None = None,
    ):
        self.role = role
        self.label = label or role
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.popen = subprocess.Popen(
            list(cmd),
            env=child_env(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._pump = threading.Thread(target=self._tee, name=f"log-{self.label}", daemon=True)
        self._pump.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def role_log(self) -> Path:
        return self.log_dir / f"{self.role}.log"

    def poll(self) -> int | None:
        return self.popen.poll()

    def tail(self) -> str:
        """The last lines the process printed (waits briefly for the log pump to drain)."""
        if self.popen.poll() is not None:
            self._pump.join(timeout=2)
        return "".join(self._tail)

    def _tee(self) -> None:
        assert self.popen.stdout is not None
        with (
            open(self.role_log, "a", encoding="utf-8") as role_log,
            open(self.log_dir / "merged.log", "a", encoding="utf-8") as merged,
        ):
            for raw in iter(self.popen.stdout.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                if not line.endswith("\n"):
                    line += "\n"
                self._tail.append(line)
                role_log.write(line)
                role_log.flush()
                merged.write(f"[{self.label}] {line}")
                merged.flush()
        self.popen.stdout.close()

    def kill_tree(self, grace: float = 5.0) -> None:
        """SIGTERM the process and its descendants, SIGKILL what is left after ``grace``."""
        kill_process_tree(self.pid, grace=grace, popen=self.popen)
        self._pump.join(timeout=2)


def read_log_tail(path: str | os.PathLike[str], lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ("" when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return "".join(text.splitlines(keepends=True)[-lines:])


def _proc_state(pid: int) -> str | None:
    """The one-letter state from ``/proc/<pid>/stat`` (None if gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            # "pid (comm) state ppid ...": comm may contain spaces and parentheses
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _proc_state(pid) not in ("Z", "X")


def _parent_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children[ppid].append(int(entry))
    return children


def descendant_pids(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []
    children = _parent_map()
    found: list[int] = []
    frontier = [pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found.extend(kids)
        frontier.extend(kids)
    return found


def _signal_all(pids: Iterable[int], group_leader: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group_leader, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_process_tree(pid: int, grace: float = 5.0, popen: subprocess.Popen | None = None) -> None:
    """Stop ``pid`` and every descendant: SIGTERM, wait up to ``grace`` s, then SIGKILL.

    ``popen`` (when ``pid`` is our child) is polled so the process is reaped rather than
    left a zombie.
    """
    kill_process_trees([pid], grace, [popen] if popen is not None else [])


def kill_process_trees(
    roots: Sequence[int], grace: float = 5.0, popens: Sequence[subprocess.Popen] = ()
) -> None:
    """:func:`kill_process_tree` for several roots at once (one shared grace period).

    Each root is assumed to lead its own process group (children are started with
    ``start_new_session``), so the groups are signalled too. Uses no threads, so it is
    safe in ``atexit`` hooks.
    """
    trees = {root: {root, *descendant_pids(root)} for root in roots}
    for root, pids in trees.items():
        _signal_all(pids, root, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        for popen in popens:
            popen.poll()
        if not any(process_alive(p) for pids in trees.values() for p in pids):
            break
        time.sleep(0.05)
    else:
        for root, pids in trees.items():
            if process_alive(root):
                pids.update(descendant_pids(root))
            _signal_all([p for p in pids if process_alive(p)], root, signal.SIGKILL)
    for popen in popens:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=5)
