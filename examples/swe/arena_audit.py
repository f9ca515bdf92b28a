"""Private JSONL audit shards: one record per Arena task outcome, appended without symlinks.

Each process appends to its own shard (``arena_results_<host>_<pid>.jsonl``) in a
directory walked from ``/`` without following symlinks and kept at mode 0700; records
carry the task's identity, scores and its ``raw`` result (dropped above a size cap).
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

__all__ = ["AuditShardWriter", "audit_record"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SHARD_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _open_private_dir(path: str) -> int:
    """A descriptor of ``path``, walked from ``/`` without following any symlink.

    Missing components are created with mode 0700; the last one must belong to the
    effective user and is set to 0700.
    """
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [p for p in os.path.abspath(path).split(os.sep) if p]:
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):  # created concurrently
                    os.mkdir(part, 0o700, dir_fd=fd)
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        if os.fstat(fd).st_uid != os.geteuid():
            raise PermissionError("the audit directory is not owned by the effective user")
        os.fchmod(fd, 0o700)
        return fd
    except BaseException:
        os.close(fd)
        raise


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

    Writes run in a thread (file I/O must not block the event loop) under an asyncio lock,
    so concurrent episodes never interleave their lines.
    """

    def __init__(self, directory: str, max_raw_bytes: int):
        self.directory = directory
        self.max_raw_bytes = max_raw_bytes
        self._lock = asyncio.Lock()

    async def append(self, record: dict[str, Any], raw: Any) -> None:
        async with self._lock:
            await asyncio.to_thread(self._write, record, raw)

    def _write(self, record: dict[str, Any], raw: Any) -> None:
        line = _audit_line(record, raw, self.max_raw_bytes)
        _append_private_line(self.directory, _shard_name(), line)
