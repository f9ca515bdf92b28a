"""Process-global key/value discovery of worker addresses.

The default backend stores each key as a directory holding a file ``ENTRY`` under a
record root on storage every node shares (``cluster.name_resolve.nfs_record_root``);
writes are atomic (temp file + rename). An in-memory backend serves single-process tests.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Protocol

__all__ = [
    "MemoryNameRecordRepository",
    "NameEntryExistsError",
    "NameEntryNotFoundError",
    "NfsNameRecordRepository",
    "add",
    "clear_subtree",
    "delete",
    "get",
    "get_subtree",
    "reconfigure",
    "reset",
    "wait",
]


class NameEntryExistsError(KeyError):
    """``add`` of an existing key without ``replace=True``."""


class NameEntryNotFoundError(KeyError):
    """``get`` or ``delete`` of a key that does not exist."""


class NameRecordRepository(Protocol):
    def add(
        self, name: str, value: str, delete_on_exit: bool = True, replace: bool = False
    ) -> None: ...
    def get(self, name: str) -> str: ...
    def delete(self, name: str) -> None: ...
    def get_subtree(self, root: str) -> list[str]: ...
    def clear_subtree(self, root: str) -> None: ...
    def reset(self) -> None: ...


def _clean(name: str) -> str:
    parts = [p for p in name.strip("/").split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"invalid name-resolve key {name!r}")
    return "/".join(parts)


class MemoryNameRecordRepository:
    """Keys in a dict; visible to this process only."""

    def __init__(self) -> None:
        self._store: dict[str, str] = {}
        self._to_delete: set[str] = set()
        self._lock = threading.Lock()

    def add(
        self, name: str, value: str, delete_on_exit: bool = True, replace: bool = False
    ) -> None:
        name = _clean(name)
        with self._lock:
            if name in self._store and not replace:
                raise NameEntryExistsError(name)
            self._store[name] = str(value)
            if delete_on_exit:
                self._to_delete.add(name)

    def get(self, name: str) -> str:
        name = _clean(name)
        with self._lock:
            if name not in self._store:
                raise NameEntryNotFoundError(name)
            return self._store[name]

    def delete(self, name: str) -> None:
        name = _clean(name)
        with self._lock:
            if self._store.pop(name, None) is None:
                raise NameEntryNotFoundError(name)
            self._to_delete.discard(name)

    def get_subtree(self, root: str) -> list[str]:
        root = _clean(root)
        with self._lock:
            return [
                v for k, v in sorted(self._store.items()) if k == root or k.startswith(root + "/")
            ]

    def clear_subtree(self, root: str) -> None:
        root = _clean(root)
        with self._lock:
            for k in [k for k in self._store if k == root or k.startswith(root + "/")]:
                del self._store[k]
                self._to_delete.discard(k)

    def reset(self) -> None:
        with self._lock:
            for k in self._to_delete:
                self._store.pop(k, None)
            self._to_delete.clear()


class NfsNameRecordRepository:
    """Keys as ``<record_root>/<key>/ENTRY`` files on shared storage."""

    ENTRY = "ENTRY"

    def __init__(self, record_root: str) -> None:
        self.record_root = Path(record_root)
        self._to_delete: set[str] = set()
        self._lock = threading.Lock()

    def _dir(self, name: str) -> Path:
        return self.record_root / _clean(name)

    def add(
        self, name: str, value: str, delete_on_exit: bool = True, replace: bool = False
    ) -> None:
        path = self._dir(name)
        entry = path / self.ENTRY
        if entry.exists() and not replace:
            raise NameEntryExistsError(_clean(name))
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix=f".{uuid.uuid4().hex}")
        with os.fdopen(fd, "w") as f:
            f.write(str(value))
        os.replace(tmp, entry)
        if delete_on_exit:
            with self._lock:
                self._to_delete.add(_clean(name))

    def get(self, name: str) -> str:
        entry = self._dir(name) / self.ENTRY
        attempts = 3
        while True:
            attempts -= 1
            try:
                return entry.read_text()
            except FileNotFoundError:
                raise NameEntryNotFoundError(_clean(name)) from None
            except OSError:  # e.g. a stale NFS file handle: retry briefly
                if attempts == 0:
                    raise
                time.sleep(0.1)

    def delete(self, name: str) -> None:
        entry = self._dir(name) / self.ENTRY
        try:
            entry.unlink()
        except FileNotFoundError:
            raise NameEntryNotFoundError(_clean(name)) from None
        with self._lock:
            self._to_delete.discard(_clean(name))

    def get_subtree(self, root: str) -> list[str]:
        base = self._dir(root)
        if not base.exists():
            return []
        return [p.read_text() for p in sorted(base.rglob(self.ENTRY))]

    def clear_subtree(self, root: str) -> None:
        shutil.rmtree(self._dir(root), ignore_errors=True)

    def reset(self) -> None:
        with self._lock:
            names, self._to_delete = list(self._to_delete), set()
        for name in names:
            (self._dir(name) / self.ENTRY).unlink(missing_ok=True)


_repository: NameRecordRepository = MemoryNameRecordRepository()


def reconfigure(config) -> NameRecordRepository:
    """Select the backend from a ``NameResolveConfig`` (``nfs``; ``memory`` for tests)."""
    global _repository
    kind = getattr(config, "type", config)
    if kind == "nfs":
        _repository = NfsNameRecordRepository(config.nfs_record_root)
    elif kind == "memory":
        _repository = MemoryNameRecordRepository()
    else:
        raise ValueError(
            f"cluster.name_resolve.type {kind!r} is not supported by this port; use 'nfs' "
            "with nfs_record_root on storage shared by all nodes"
        )
    return _repository


def add(name: str, value: str, delete_on_exit: bool = True, replace: bool = False) -> None:
    _repository.add(name, value, delete_on_exit=delete_on_exit, replace=replace)


def get(name: str) -> str:
    return _repository.get(name)


def delete(name: str) -> None:
    _repository.delete(name)


def get_subtree(root: str) -> list[str]:
    return _repository.get_subtree(root)


def clear_subtree(root: str) -> None:
    _repository.clear_subtree(root)


def reset() -> None:
    """Delete every entry this process added with ``delete_on_exit``."""
    _repository.reset()


def wait(name: str, timeout: float | None = None, poll_interval: float = 0.1) -> str:
    """Poll until ``name`` exists; ``TimeoutError`` after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return get(name)
        except NameEntryNotFoundError:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"name-resolve key {name!r} did not appear in {timeout}s"
                ) from None
            time.sleep(poll_interval)


atexit.register(lambda: _repository.reset())
