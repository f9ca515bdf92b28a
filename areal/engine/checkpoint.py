"""Checkpoint plumbing shared by the train engines: format dispatch and per-rank extras.

:class:`CheckpointFormats` gives an engine ``save``/``load`` for ``SaveLoadMeta`` with
``weight_format`` ``hf`` (``_save_hf`` / ``_load_hf``) or ``dcp`` (``_save_dcp`` /
``_load_dcp``). Beside a DCP checkpoint each rank keeps a small extra-state file (weight
version, RNG states and engine-specific fields such as the LR schedule position):
:func:`write_extra_state` and :func:`read_extra_state`, the latter also restoring the RNGs.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from areal.api.io_struct import SaveLoadMeta

__all__ = ["EXTRA_STATE", "CheckpointFormats", "read_extra_state", "write_extra_state"]

EXTRA_STATE = "extra_state_rank{rank}.pt"


class CheckpointFormats:
    """Mixin: ``save`` / ``load`` by ``meta.weight_format`` (``hf`` or ``dcp``)."""

    def save(self, meta: SaveLoadMeta) -> None:
        if meta.weight_format == "hf":
            self._save_hf(meta.path, meta.tokenizer)
        elif meta.weight_format == "dcp":
            self._save_dcp(meta.path, meta.with_optim)
        else:
            raise ValueError(f"weight_format must be 'hf' or 'dcp', got {meta.weight_format!r}")

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
    torch.save(extra, Path(path) / EXTRA_STATE.format(rank=dist.get_rank()))


def read_extra_state(path: str) -> dict[str, Any] | None:
    """This rank's extra state (RNGs restored), or ``None`` when the file is absent."""
    extra_file = Path(path) / EXTRA_STATE.format(rank=dist.get_rank())
    if not extra_file.exists():
        return None
    extra = torch.load(extra_file, weights_only=False)
    _set_rng_state(extra["rng"])
    return extra


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
