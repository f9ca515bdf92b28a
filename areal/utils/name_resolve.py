"""Process-global key/value discovery of worker addresses.

The default backend stores each key as a directory holding a file ``ENTRY`` under a
record root on storage every node shares (``cluster.name_resolve.nfs_record_root``);
writes are atomic (temp file + rename). Directories are created 0700, and a record that
another user could have written (a path not owned by the current user, group- or
world-writable, or a symbolic link) is refused with :class:`UnsafeNameRecordError`
rather than believed. An in-memory backend serves single-process tests.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import stat
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
    "UnsafeNameRecordError",
    "add",
    "claim_subtree",
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
    def claim_subtree(self, root: str) -> None: ...
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

    def claim_subtree(self, root: str) -> None:
        _clean(root)  # nothing on disk to claim

    def reset(self) -> None:
        with self._lock:
            for k in self._to_delete:
                self._store.pop(k, None)
            self._to_delete.clear()


class UnsafeNameRecordError(PermissionError):
    """A record, or a directory on its path, that another user could have written."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


class NfsNameRecordRepository:
    """Keys as ``<record_root>/<key>/ENTRY`` files on shared storage.

    Records tell the controller where to send its requests, so only records nobody else
    could have written are believed. Directories are created mode 0700 and entries 0600;
    every directory from the record root down and every ``ENTRY`` must be owned by the
    current user and not be group- or world-writable, and nothing below the root may be
    a symbolic link. Otherwise :class:`UnsafeNameRecordError` names the path and the fix,
    and the record is not read. The one exception is a shared record root with the
    sticky bit (mode 1777 like ``/tmp``), where others cannot touch what is ours.
    Paths are walked with directory descriptors, so nothing can be swapped in between
    the check and the read. The same user on every node of a cluster passes.
    """

    ENTRY = "ENTRY"

    def __init__(self, record_root: str) -> None:
        self.record_root = Path(record_root)
        self._to_delete: set[str] = set()
        self._lock = threading.Lock()

    # --- safe paths ---

    def _refuse(self, path: Path, problem: str) -> UnsafeNameRecordError:
        root = self.record_root
        return UnsafeNameRecordError(
            f"refusing name-resolve record path {path}: {problem}. Another user may have "
            f"planted it to receive this run's requests. Use a private "
            f"cluster.name_resolve.nfs_record_root that only you own (mode 700), or remove "
            f"what is not yours and run: chmod 700 {root} && chmod -R go-w {root}"
        )

    def _denied(self, path: Path) -> UnsafeNameRecordError:
        try:
            st = os.lstat(path)
        except OSError:
            return self._refuse(path, "you may not open it")
        mode = stat.S_IMODE(st.st_mode)
        return self._refuse(
            path, f"you may not open it (owned by {_owner_name(st.st_uid)}, mode {mode:o})"
        )

    def _check(self, fd: int, path: Path, kind: str, shared_ok: bool = False) -> None:
        st = os.fstat(fd)
        is_kind = stat.S_ISDIR(st.st_mode) if kind == "dir" else stat.S_ISREG(st.st_mode)
        if not is_kind:
            raise self._refuse(path, f"it is not a {'directory' if kind == 'dir' else 'file'}")
        if shared_ok and st.st_mode & stat.S_ISVTX and st.st_mode & stat.S_IWOTH:
            return  # like /tmp: others may add entries but not touch ours
        me = os.geteuid()
        if st.st_uid != me:
            raise self._refuse(
                path, f"it is owned by {_owner_name(st.st_uid)}, not by you ({_owner_name(me)})"
            )
        if st.st_mode & _OTHERS_WRITE:
            who = "group- and world" if st.st_mode & stat.S_IWOTH else "group"
            if not st.st_mode & stat.S_IWGRP:
                who = "world"
            raise self._refuse(path, f"it is {who}-writable (mode {stat.S_IMODE(st.st_mode):o})")

    def _open_root(self, create: bool) -> int:
        root = self.record_root
        if create and not root.exists():
            root.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(root, 0o700)
        try:
            fd = os.open(root, _DIR_FLAGS)
        except FileNotFoundError:
            raise NameEntryNotFoundError(str(root)) from None
        except NotADirectoryError:
            raise self._refuse(root, "it is not a directory") from None
        except PermissionError:
            raise self._denied(root) from None
        try:
            self._check(fd, root, "dir", shared_ok=True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_dir(self, parts: list[str], create: bool = False) -> int:
        """A descriptor of ``record_root/parts...`` (each step checked); the caller closes it."""
        fd = self._open_root(create)
        path = self.record_root
        try:
            for part in parts:
                path = path / part
                try:
                    child = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise NameEntryNotFoundError(str(path)) from None
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o700, dir_fd=fd)
                    child = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
                except PermissionError:
                    raise self._denied(path) from None
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    raise self._refuse(path, "it is a symbolic link or not a directory") from None
                os.close(fd)
                fd = child
                self._check(fd, path, "dir")
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _read_entry(self, dir_fd: int, path: Path) -> str:
        try:
            fd = os.open(self.ENTRY, os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)
        except FileNotFoundError:
            raise NameEntryNotFoundError(str(path)) from None
        except PermissionError:
            raise self._denied(path / self.ENTRY) from None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise self._refuse(path / self.ENTRY, "it is a symbolic link") from None
        with os.fdopen(fd, "rb") as f:
            self._check(f.fileno(), path / self.ENTRY, "file")
            return f.read().decode("utf-8")

    # --- the repository ---

    def add(
        self, name: str, value: str, delete_on_exit: bool = True, replace: bool = False
    ) -> None:
        key = _clean(name)
        fd = self._open_dir(key.split("/"), create=True)
        try:
            exists = True
            try:
                os.stat(self.ENTRY, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                exists = False
            if exists and not replace:
                raise NameEntryExistsError(key)
            tmp = f".{uuid.uuid4().hex}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
            with os.fdopen(os.open(tmp, flags, 0o600, dir_fd=fd), "w") as f:
                f.write(str(value))
            os.replace(tmp, self.ENTRY, src_dir_fd=fd, dst_dir_fd=fd)
        finally:
            os.close(fd)
        if delete_on_exit:
            with self._lock:
                self._to_delete.add(key)

    def get(self, name: str) -> str:
        key = _clean(name)
        attempts = 3
        while True:
            attempts -= 1
            try:
                fd = self._open_dir(key.split("/"))
                try:
                    return self._read_entry(fd, self.record_root / key)
                finally:
                    os.close(fd)
            except NameEntryNotFoundError:
                raise NameEntryNotFoundError(key) from None
            except UnsafeNameRecordError:
                raise
            except OSError:  # e.g. a stale NFS file handle: retry briefly
                if attempts == 0:
                    raise
                time.sleep(0.1)

    def delete(self, name: str) -> None:
        key = _clean(name)
        try:
            fd = self._open_dir(key.split("/"))
        except NameEntryNotFoundError:
            raise NameEntryNotFoundError(key) from None
        try:
            os.unlink(self.ENTRY, dir_fd=fd)
        except FileNotFoundError:
            raise NameEntryNotFoundError(key) from None
        finally:
            os.close(fd)
        with self._lock:
            self._to_delete.discard(key)

    def get_subtree(self, root: str) -> list[str]:
        key = _clean(root)
        try:
            fd = self._open_dir(key.split("/"))
        except NameEntryNotFoundError:
            return []
        found: list[tuple[tuple[str, ...], str]] = []
        try:
            for dirpath, _dirs, files, dir_fd in os.fwalk(".", dir_fd=fd):
                rel = Path(dirpath)
                path = self.record_root / key / rel
                self._check(dir_fd, path, "dir")
                if self.ENTRY in files:
                    found.append(((*rel.parts, self.ENTRY), self._read_entry(dir_fd, path)))
        finally:
            os.close(fd)
        return [value for _, value in sorted(found)]

    def clear_subtree(self, root: str) -> None:
        parts = _clean(root).split("/")
        try:
            fd = self._open_dir(parts[:-1])
        except NameEntryNotFoundError:
            return
        try:
            st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            os.close(fd)
            return
        try:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(parts[-1], dir_fd=fd, ignore_errors=True)
            else:
                os.unlink(parts[-1], dir_fd=fd)
        finally:
            os.close(fd)

    def claim_subtree(self, root: str) -> None:
        """Create ``root``'s directories (0700) and check the whole path is private."""
        os.close(self._open_dir(_clean(root).split("/"), create=True))

    def reset(self) -> None:
        with self._lock:
            names, self._to_delete = list(self._to_delete), set()
        for name in names:
            with contextlib.suppress(NameEntryNotFoundError, OSError):
                self.delete(name)


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


def claim_subtree(root: str) -> None:
    """Make ``root`` exist as this user's private directories (or raise why it cannot)."""
    _repository.claim_subtree(root)


def reset() -> None:
    """Delete every entry this process added with ``delete_on_exit``."""
    _repository.reset()


FAST_POLL_SECONDS = 1.0  # how long wait(first_interval=...) polls fast


def wait(
    name: str,
    timeout: float | None = None,
    poll_interval: float = 0.1,
    first_interval: float | None = None,
) -> str:
    """Poll until ``name`` exists; ``TimeoutError`` after ``timeout`` seconds.

    With ``first_interval`` the first second polls that often, then every
    ``poll_interval``: a key that usually appears within milliseconds is seen at once,
    and a slow one does not cost the shared file system a look every few milliseconds.
    """
    began = time.monotonic()
    deadline = None if timeout is None else began + timeout
    while True:
        try:
            return get(name)
        except NameEntryNotFoundError:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"name-resolve key {name!r} did not appear in {timeout}s"
                ) from None
            fast = first_interval is not None and now - began < FAST_POLL_SECONDS
            time.sleep(min(first_interval, poll_interval) if fast else poll_interval)


atexit.register(lambda: _repository.reset())
