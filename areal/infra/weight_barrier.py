"""The rollout side's one pause and version source: the weight-update barrier state.

Each rollout worker's engine owns one :class:`BarrierState`: whether the barrier is
closed (a weight update is in progress: no rollout starts and no generation request is
sent) and the weight version that tokens generated now are tagged with. The workflow
executor, the engine's interruptible ``agenerate`` and the worker's rollout proxies all
read this one state; the proxies are child processes, so the state lives in a small
memory-mapped file whose path they are given (:meth:`BarrierState.attach`).

That file has no name in any directory: it is an anonymous memory file (``memfd``) held
open by its owner, and peers open it as ``/proc/<owner pid>/fd/<n>``. The kernel frees it
with the last process that maps it, so nothing is left behind however the owner ends
(close, exception, SIGTERM, ``kill -9``); the path stops working once the owner closes
it or exits. Where ``memfd_create`` is missing (not Linux), a temporary file stands in,
removed at :meth:`~BarrierState.close`, when the state is garbage-collected, or at exit.

The controller drives it (``RolloutController.begin_weight_update`` /
``end_weight_update``): ``begin(version)`` closes it, ``end(version)`` sets the version
and opens it. One 8-byte word holds both (``version << 1 | closed``), so a reader never
sees a version without its pause flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import struct
import tempfile
import weakref

__all__ = ["BarrierState"]

_WORD = struct.Struct("<q")
POLL_SECONDS = 0.05  # how often a held request looks at the barrier again


def _state_file() -> tuple[int, str, str | None]:
    """A new, empty file for a state: its descriptor, the path peers open, the name to
    remove when done (``None``: the file has none)."""
    proc_fd = f"/proc/{os.getpid()}/fd"
    if hasattr(os, "memfd_create") and os.path.isdir(proc_fd):
        with contextlib.suppress(OSError):  # e.g. a seccomp filter refusing the call
            fd = os.memfd_create("areal-barrier")  # close-on-exec: children open the path
            return fd, f"{proc_fd}/{fd}", None
    fd, path = tempfile.mkstemp(prefix="areal-barrier-", suffix=".bin")
    return fd, path, path


def _release(fd: int, name: str | None, creator: int) -> None:
    os.close(fd)
    if name is not None and os.getpid() == creator:  # never from a forked child's exit
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


class BarrierState:
    """Closed flag and weight version of one rollout worker (see the module docstring).

    ``BarrierState(version)`` creates a fresh, open state in a new file that it releases
    at :meth:`close` (or when garbage-collected); :meth:`attach` reads another process's
    state, read-only.
    """

    def __init__(self, version: int = 0) -> None:
        fd, self.path, name = _state_file()
        try:
            os.write(fd, _WORD.pack(version << 1))
            self._map = mmap.mmap(fd, _WORD.size)
        except BaseException:
            _release(fd, name, os.getpid())
            raise
        self._owner = True
        self.held = 0
        # the descriptor keeps the path open for peers that attach later
        self._release = weakref.finalize(self, _release, fd, name, os.getpid())

    @classmethod
    def attach(cls, path: str) -> BarrierState:
        """A read-only view of the state at ``path`` (written by a rollout worker)."""
        state = cls.__new__(cls)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != _WORD.size:  # a stale path: the owner's descriptor number reused
                raise ValueError(f"{path} is not a barrier state ({size} bytes, not 8)")
            state._map = mmap.mmap(f.fileno(), _WORD.size, access=mmap.ACCESS_READ)
        state.path = path
        state._owner = False
        state.held = 0
        return state

    def _word(self) -> int:
        return _WORD.unpack_from(self._map, 0)[0]

    def _write(self, version: int, closed: bool) -> None:
        if not self._owner:
            raise RuntimeError(f"the barrier state {self.path} belongs to its rollout worker")
        if version < 0:
            raise ValueError(f"a weight version is never negative, got {version}")
        self._map[0 : _WORD.size] = _WORD.pack(version << 1 | int(closed))

    @property
    def closed(self) -> bool:
        """True between ``begin`` and ``end`` of a weight update."""
        return bool(self._word() & 1)

    @property
    def version(self) -> int:
        return self._word() >> 1

    def begin(self) -> None:
        """Close: no rollout starts, no generation request is sent (the version stays)."""
        self._write(self.version, True)

    def end(self, version: int) -> None:
        """Set ``version`` and open (also a plain version change when not closed)."""
        self._write(version, False)

    def set_version(self, version: int) -> None:
        """Set ``version``, closed or open as before (recovery, tests)."""
        self._write(version, self.closed)

    async def wait_open(self) -> int:
        """Wait while closed; the version to tag the next generated tokens with.

        ``held`` counts the callers of this process that the closed barrier holds now (so
        a test can see a request parked here instead of guessing with a sleep).
        """
        word = self._word()
        if not word & 1:
            return word >> 1
        self.held += 1
        try:
            while word & 1:
                await asyncio.sleep(POLL_SECONDS)
                word = self._word()
            return word >> 1
        finally:
            self.held -= 1

    def close(self) -> None:
        """The owner releases the state file: its path stops working (processes that
        mapped it keep their view); this object stays readable."""
        if self._owner:
            self._release()
