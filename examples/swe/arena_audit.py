"""Private JSONL audit shards: one record per Arena task outcome, appended without symlinks.

Each process appends to its own shard (``arena_results_<host>_<pid>.jsonl``) in a
directory walked from ``/`` without following symlinks and kept at mode 0700; records
carry the task's identity, scores and its ``raw`` result (dropped above a size cap).
:class:`AuditShardWriter` checks the directory when it is created, so a symlinked, foreign
or unwritable ``econfig.arena_result_dump_dir`` fails the run at start instead of every
record being dropped with a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
from collections.abc import Mapping
from typing import Any

from examples.swe.arena_agent_common import clean_text
from examples.swe.arena_results import ArenaTaskResult
from examples.swe.arena_types import ArenaStreamConfig

__all__ = ["AuditDirError", "AuditShardWriter", "audit_record", "check_audit_dir"]

FIELD = "econfig.arena_result_dump_dir"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SHARD_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class AuditDirError(OSError):
    """The audit directory cannot hold shards: a symlink on its path, not ours, unwritable."""


def _enter(fd: int, part: str, shown: str) -> int:
    """A descriptor of directory ``part`` in ``fd`` (created 0700 if missing), no symlink."""
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):  # created concurrently
            os.mkdir(part, 0o700, dir_fd=fd)
        return os.open(part, _DIR_FLAGS, dir_fd=fd)
    except OSError as e:
        try:
            is_link = stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        if is_link:
            raise AuditDirError(
                f"{shown} is a symbolic link; audit shards are never written through links "
                f"(use the real path {os.path.realpath(shown)!r})"
            ) from None
        raise AuditDirError(f"{shown} is not a usable directory ({e.strerror})") from None


def _open_private_dir(path: str) -> int:
    """A descriptor of ``path``, walked from ``/`` without following any symlink.

    Missing components are created with mode 0700; the last one must belong to the
    effective user and is set to 0700.
    """
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = ""
    try:
        for part in [p for p in os.path.abspath(path).split(os.sep) if p]:
            shown += os.sep + part
            child = _enter(fd, part, shown)
            os.close(fd)
            fd = child
        if os.fstat(fd).st_uid != os.geteuid():
            raise AuditDirError("the audit directory is not owned by the effective user")
        os.fchmod(fd, 0o700)
        return fd
    except BaseException:
        os.close(fd)
        raise


def check_audit_dir(directory: str) -> None:
    """Raise :class:`ValueError` naming the field unless shards can be written to ``directory``.

    Creates the directory (0700) when missing, and writes and removes a probe file.
    """
    try:
        dir_fd = _open_private_dir(directory)
        try:
            probe = f".probe_{os.getpid()}_{os.urandom(4).hex()}"
            fd = os.open(probe, _SHARD_FLAGS | os.O_EXCL, 0o600, dir_fd=dir_fd)
            os.close(fd)
            os.unlink(probe, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        reason = str(e) if isinstance(e, AuditDirError) else f"cannot write to it ({e.strerror})"
        raise ValueError(
            f"{FIELD} {directory!r}: {reason}; every audit record would be lost. Point it at "
            "a writable directory owned by this user, or set it to '' to disable audit shards"
        ) from None


def _append_private_line(directory: str, filename: str, line: bytes) -> None:
    """Append ``line`` to ``directory/filename`` (regular, ours, mode 0600, no symlinks)."""
    dir_fd = _open_private_dir(directory)
    try:
        fd = os.open(filename, _SHARD_FLAGS, 0o600, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise PermissionError("the audit shard is not a regular file of the effective user")
        os.fchmod(fd, 0o600)
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _audit_line(record: dict[str, Any], raw: Any, max_raw_bytes: int) -> bytes:
    """The JSONL line of ``record``, with ``raw`` dropped when it exceeds the cap."""
    size = len(_compact_json(raw).encode("utf-8"))
    truncated = size > max_raw_bytes
    record["raw"] = None if truncated else raw
    record["raw_present"] = raw is not None
    record["raw_size_bytes"] = size
    record["raw_truncated"] = truncated
    return (_compact_json(record) + "\n").encode("utf-8")


def _shard_name() -> str:
    host = socket.gethostname().replace(os.sep, "_") or "localhost"
    return f"arena_results_{host}_{os.getpid()}.jsonl"


def audit_record(
    stream: ArenaStreamConfig,
    data: Mapping[str, Any],
    result: ArenaTaskResult,
    training_score: float | None,
    identity: Mapping[str, Any],
) -> dict[str, Any]:
    """The audit record of ``result`` (its ``raw`` is filled in by the writer)."""
    pin = stream.expected_reward_ref
    return {
        "arena_stream_name": stream.name,
        "stream_id": clean_text(data.get("stream_id")) or stream.stream_id,
        "data_id": clean_text(data.get("data_id")),
        "task_id": result.task_id,
        "status": result.status,
        "expected_reward_ref": {"key": pin.key, "version": pin.version},
        "arena_score": result.score,
        "training_score": training_score,
        "raw": None,
        "raw_present": False,
        "raw_size_bytes": 0,
        "raw_truncated": False,
        "artifacts_uri": result.artifacts_uri,
        "trace_id": result.trace_id,
        "computed_at": result.computed_at,
        **identity,
    }


class AuditShardWriter:
    """Appends records to this process's shard in ``directory``, one write at a time.

    An empty ``directory`` disables the shards; any other is checked at construction
    (:func:`check_audit_dir`), which raises ``ValueError`` naming the field.

    Writes run in a thread (file I/O must not block the event loop) under an asyncio lock,
    so concurrent episodes never interleave their lines.
    """

    def __init__(self, directory: str, max_raw_bytes: int):
        self.directory = directory
        self.max_raw_bytes = max_raw_bytes
        self._lock = asyncio.Lock()
        if directory:
            check_audit_dir(directory)

    async def append(self, record: dict[str, Any], raw: Any) -> None:
        async with self._lock:
            await asyncio.to_thread(self._write, record, raw)

    def _write(self, record: dict[str, Any], raw: Any) -> None:
        line = _audit_line(record, raw, self.max_raw_bytes)
        _append_private_line(self.directory, _shard_name(), line)
