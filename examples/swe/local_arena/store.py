"""The local Arena's state in SQLite: registered LLM routes, tasks and their results.

One file-backed database in WAL mode, so that routes, tasks and results survive a
restart. A task that was pending or running when the server stopped cannot be resumed
(its harness process is gone): :meth:`Store.open` marks it ``SETUP_FAILED`` with
``raw.error`` saying so, so a poller gets a terminal status instead of waiting forever.

The database holds the upstream keys of registered routes (the gateway needs them after
a restart), so it is created readable by its owner only. Launch keys and environments
are never stored: they live only as long as the task runs.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["INTERRUPTED_ERROR", "Route", "Store", "TaskRecord", "utc_now"]

INTERRUPTED_ERROR = "the local Arena stopped while this task was running; launch it again"
ACTIVE_STATUSES = ("PENDING", "RUNNING")

SCHEMA = """
CREATE TABLE IF NOT EXISTS routes (
    model_name TEXT PRIMARY KEY,
    upstream_model TEXT NOT NULL,
    base_url TEXT NOT NULL,
    api_key TEXT NOT NULL,
    deployment_id TEXT NOT NULL,
    inbound_protos TEXT NOT NULL,
    metadata TEXT NOT NULL,
    enabled INTEGER NOT NULL,
    created_at REAL NOT NULL,
    renewed_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tasks (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT UNIQUE NOT NULL,
    stream_id TEXT NOT NULL,
    data_id TEXT NOT NULL,
    harness_key TEXT NOT NULL,
    harness_version TEXT NOT NULL,
    reward_key TEXT NOT NULL,
    reward_version TEXT NOT NULL,
    model_name TEXT NOT NULL,
    session_id TEXT NOT NULL,
    status TEXT NOT NULL,
    score REAL,
    raw TEXT,
    artifacts_uri TEXT,
    trace_id TEXT,
    computed_at TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS tasks_by_stream ON tasks (stream_id, seq);
"""


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Route:
    model_name: str
    upstream_model: str
    base_url: str
    api_key: str
    deployment_id: str
    inbound_protos: list[str]
    metadata: dict[str, Any]
    enabled: bool
    created_at: float
    renewed_at: float

    def public(self) -> dict[str, Any]:
        """The route as the API shows it (the upstream key is never echoed)."""
        return {
            "model_name": self.model_name,
            "enabled": self.enabled,
            "endpoints": [
                {
                    "endpoint_id": self.deployment_id,
                    "upstream_model": self.upstream_model,
                    "base_url": self.base_url,
                    "inbound_protos": self.inbound_protos,
                    "enabled": self.enabled,
                }
            ],
            "metadata": self.metadata,
            "created_at": _iso(self.created_at),
            "renewed_at": _iso(self.renewed_at),
        }


@dataclass
class TaskRecord:
    task_id: str
    stream_id: str
    data_id: str
    harness_key: str
    harness_version: str
    reward_key: str
    reward_version: str
    model_name: str
    session_id: str
    status: str
    score: float | None
    raw: Any
    artifacts_uri: str | None
    trace_id: str | None
    computed_at: str | None
    created_at: str
    updated_at: str

    def envelope(self) -> dict[str, Any]:
        """The result envelope: top-level ``score`` and ``raw`` plus provenance tags."""
        return {
            "task_id": self.task_id,
            "status": self.status,
            "score": self.score,
            "raw": self.raw,
            "artifacts_uri": self.artifacts_uri,
            "trace_id": self.trace_id,
            "computed_at": self.computed_at,
            "stream_id": self.stream_id,
            "data_id": self.data_id,
            "harness_ref": {"key": self.harness_key, "version": self.harness_version},
            "reward_ref": {"key": self.reward_key, "version": self.reward_version},
            "tags": [
                f"stream:{self.stream_id}",
                f"harness:{self.harness_key}@{self.harness_version}",
                f"reward:{self.reward_key}@{self.reward_version}",
            ],
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Store:
    """Thread-safe access to the database (one connection, one lock)."""

    def __init__(self, connection: sqlite3.Connection, path: Path):
        self._db = connection
        self._lock = threading.Lock()
        self.path = path

    @classmethod
    def open(cls, path: str | Path) -> Store:
        """Open (creating if needed) and fail the tasks a previous run left unfinished."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.touch(mode=0o600)
        connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        connection.row_factory = sqlite3.Row
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.executescript(SCHEMA)
        for sidecar in (
            path,
            path.with_name(path.name + "-wal"),
            path.with_name(path.name + "-shm"),
        ):
            if sidecar.exists():
                os.chmod(sidecar, 0o600)  # route keys are in here
        store = cls(connection, path)
        store.fail_interrupted()
        return store

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _execute(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    # --- routes ---

    def put_route(self, route: Route) -> bool:
        """Insert or replace a route; ``True`` when it was new."""
        with self._lock:
            existed = self._db.execute(
                "SELECT 1 FROM routes WHERE model_name = ?", (route.model_name,)
            ).fetchone()
            self._db.execute(
                "INSERT OR REPLACE INTO routes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    route.model_name,
                    route.upstream_model,
                    route.base_url,
                    route.api_key,
                    route.deployment_id,
                    json.dumps(route.inbound_protos),
                    json.dumps(route.metadata),
                    int(route.enabled),
                    route.created_at,
                    route.renewed_at,
                ),
            )
        return existed is None

    def get_route(self, model_name: str) -> Route | None:
        row = self._execute("SELECT * FROM routes WHERE model_name = ?", (model_name,)).fetchone()
        if row is None:
            return None
        return Route(
            model_name=row["model_name"],
            upstream_model=row["upstream_model"],
            base_url=row["base_url"],
            api_key=row["api_key"],
            deployment_id=row["deployment_id"],
            inbound_protos=json.loads(row["inbound_protos"]),
            metadata=json.loads(row["metadata"]),
            enabled=bool(row["enabled"]),
            created_at=row["created_at"],
            renewed_at=row["renewed_at"],
        )

    def list_routes(self) -> list[Route]:
        names = [r[0] for r in self._execute("SELECT model_name FROM routes ORDER BY model_name")]
        return [route for name in names if (route := self.get_route(name)) is not None]

    def renew_route(self, model_name: str) -> bool:
        cursor = self._execute(
            "UPDATE routes SET renewed_at = ? WHERE model_name = ?", (time.time(), model_name)
        )
        return cursor.rowcount > 0

    def delete_route(self, model_name: str) -> bool:
        cursor = self._execute("DELETE FROM routes WHERE model_name = ?", (model_name,))
        return cursor.rowcount > 0

    def expire_routes(self, ttl: float) -> list[str]:
        """Delete routes neither registered nor renewed in the last ``ttl`` seconds."""
        cutoff = time.time() - ttl
        with self._lock:
            names = [
                r[0]
                for r in self._db.execute(
                    "SELECT model_name FROM routes WHERE renewed_at < ?", (cutoff,)
                )
            ]
            self._db.execute("DELETE FROM routes WHERE renewed_at < ?", (cutoff,))
        return names

    # --- tasks ---

    def add_task(self, record: TaskRecord) -> None:
        self._execute(
            "INSERT INTO tasks (task_id, stream_id, data_id, harness_key, harness_version, "
            "reward_key, reward_version, model_name, session_id, status, score, raw, "
            "artifacts_uri, trace_id, computed_at, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                record.task_id,
                record.stream_id,
                record.data_id,
                record.harness_key,
                record.harness_version,
                record.reward_key,
                record.reward_version,
                record.model_name,
                record.session_id,
                record.status,
                record.score,
                None if record.raw is None else json.dumps(record.raw),
                record.artifacts_uri,
                record.trace_id,
                record.computed_at,
                record.created_at,
                record.updated_at,
            ),
        )

    def set_status(self, task_id: str, status: str) -> None:
        self._execute(
            "UPDATE tasks SET status = ?, updated_at = ? WHERE task_id = ?",
            (status, utc_now(), task_id),
        )

    def finish_task(
        self,
        task_id: str,
        status: str,
        score: float | None,
        raw: Any,
        artifacts_uri: str | None = None,
        trace_id: str | None = None,
    ) -> None:
        now = utc_now()
        self._execute(
            "UPDATE tasks SET status = ?, score = ?, raw = ?, artifacts_uri = ?, trace_id = ?, "
            "computed_at = ?, updated_at = ? WHERE task_id = ?",
            (status, score, json.dumps(raw), artifacts_uri, trace_id, now, now, task_id),
        )

    def get_task(self, task_id: str) -> TaskRecord | None:
        row = self._execute("SELECT * FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
        return None if row is None else _task(row)

    def list_tasks(self, stream_id: str, limit: int, offset: int) -> tuple[list[TaskRecord], int]:
        """The Stream's tasks, newest first, and how many there are in all."""
        rows = self._execute(
            "SELECT * FROM tasks WHERE stream_id = ? ORDER BY seq DESC LIMIT ? OFFSET ?",
            (stream_id, limit, offset),
        ).fetchall()
        (total,) = self._execute(
            "SELECT COUNT(*) FROM tasks WHERE stream_id = ?", (stream_id,)
        ).fetchone()
        return [_task(r) for r in rows], total

    def fail_interrupted(self) -> int:
        """Mark tasks left pending or running by a previous process ``SETUP_FAILED``."""
        now = utc_now()
        cursor = self._execute(
            f"UPDATE tasks SET status = 'SETUP_FAILED', raw = ?, computed_at = ?, updated_at = ? "
            f"WHERE status IN {ACTIVE_STATUSES!r}",
            (json.dumps({"error": INTERRUPTED_ERROR}), now, now),
        )
        return cursor.rowcount


def _task(row: sqlite3.Row) -> TaskRecord:
    return TaskRecord(
        task_id=row["task_id"],
        stream_id=row["stream_id"],
        data_id=row["data_id"],
        harness_key=row["harness_key"],
        harness_version=row["harness_version"],
        reward_key=row["reward_key"],
        reward_version=row["reward_version"],
        model_name=row["model_name"],
        session_id=row["session_id"],
        status=row["status"],
        score=row["score"],
        raw=None if row["raw"] is None else json.loads(row["raw"]),
        artifacts_uri=row["artifacts_uri"],
        trace_id=row["trace_id"],
        computed_at=row["computed_at"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )
