"""Checkpoint plumbing shared by the train engines: format dispatch and per-rank extras.

:class:`CheckpointFormats` gives an engine ``save``/``load`` for ``SaveLoadMeta`` with
``weight_format`` ``hf`` (``_save_hf`` / ``_load_hf``) or ``dcp`` (``_save_dcp`` /
``_load_dcp``). Beside a DCP checkpoint each rank keeps a small extra-state file (weight
version, RNG states and engine-specific fields such as the LR schedule position):
:func:`write_extra_state` and :func:`read_extra_state`, the latter also restoring the RNGs.

A save that fails raises :func:`write_error`: an :class:`OSError` naming the checkpoint
path and the OS error (``[Errno 28] No space left on device: '<path>'``) when one explains
it. The libraries hide it: a DCP save raises ``CheckpointException`` (a ``BaseException``
holding each rank's failure) and torch's zip writer a bare ``RuntimeError``.
"""

from __future__ import annotations

import errno
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from areal.api.io_struct import SaveLoadMeta

__all__ = [
    "EXTRA_STATE",
    "CheckpointFormats",
    "read_extra_state",
    "write_error",
    "write_extra_state",
]

EXTRA_STATE = "extra_state_rank{rank}.pt"


class CheckpointFormats:
    """Mixin: ``save`` / ``load`` by ``meta.weight_format`` (``hf`` or ``dcp``)."""

    def save(self, meta: SaveLoadMeta) -> None:
        if meta.weight_format not in ("hf", "dcp"):
            raise ValueError(f"weight_format must be 'hf' or 'dcp', got {meta.weight_format!r}")
        try:
            if meta.weight_format == "hf":
                self._save_hf(meta.path, meta.tokenizer)
            else:
                self._save_dcp(meta.path, meta.with_optim)
        except (Exception, CheckpointException) as error:
            raise write_error(error, meta.path, meta.weight_format) from error

    def load(self, meta: SaveLoadMeta) -> None:
        if meta.weight_format == "dcp":
            self._load_dcp(meta.path, meta.with_optim)
        elif meta.weight_format == "hf":
            self._load_hf(meta.path)
        else:
            raise ValueError(f"weight_format must be 'hf' or 'dcp', got {meta.weight_format!r}")


def write_extra_state(path: str, **fields: Any) -> None:
    """This rank's extra state (``fields`` plus the RNG states) beside a DCP checkpoint."""
    extra = {**fields, "rng": _rng_state()}
    # through a Python file: torch's own file writer reports a full disk without the errno
    with open(Path(path) / EXTRA_STATE.format(rank=dist.get_rank()), "wb") as f:
        torch.save(extra, f)


def read_extra_state(path: str) -> dict[str, Any] | None:
    """This rank's extra state (RNGs restored), or ``None`` when the file is absent."""
    extra_file = Path(path) / EXTRA_STATE.format(rank=dist.get_rank())
    if not extra_file.exists():
        return None
    extra = torch.load(extra_file, weights_only=False)
    _set_rng_state(extra["rng"])
    return extra


def write_error(error: BaseException, path: str, weight_format: str = "") -> Exception:
    """The error to raise for a ``weight_format`` checkpoint at ``path`` that ``error``
    interrupted: ``OSError(errno, strerror, path)`` when an OS error explains it (found in
    ``error``, the ranks' failures it holds and their causes, or a file system left with
    no space), else a ``RuntimeError`` naming the path."""
    found = next((e for e in _chain(error) if _file_error(e)), None)
    if found is not None:
        return OSError(found.errno, os.strerror(found.errno), found.filename or path)
    if _out_of_space(path):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    what = f"the {weight_format} checkpoint" if weight_format else "the checkpoint"
    # a DCP save's own exception is a traceback dump: say what the first rank raised
    reason = next((e for e in _chain(error) if not isinstance(e, CheckpointException)), error)
    return RuntimeError(f"writing {what} at {path} failed: {type(reason).__name__}: {reason}")


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, the per-rank failures it wraps (a DCP save's), their causes and contexts."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, CheckpointException):
            pending += [f[0] if isinstance(f, tuple) else f for f in current.failures.values()]
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]


def _file_error(error: BaseException) -> bool:
    """An OS error with an errno that is no network one (a collective's peer gone)."""
    network = (ConnectionError, TimeoutError)
    return isinstance(error, OSError) and bool(error.errno) and not isinstance(error, network)


def _out_of_space(path: str) -> bool:
    """Whether the file system holding ``path`` has no block or no inode left to write."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        st = os.statvfs(existing)
    except OSError:
        return False
    # root may write into the blocks reserved for it
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return blocks == 0 or (st.f_ffree == 0 and st.f_files > 0)


def _rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
