"""Standard locations under ``cluster.fileroot``."""

from __future__ import annotations

import getpass
import os
from pathlib import Path

__all__ = ["get_checkpoint_path", "get_log_path", "get_user"]


def get_user() -> str:
    """Login name of the process owner (falls back to ``$USER`` or the uid)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return os.environ.get("USER") or str(os.getuid())


def get_log_path(fileroot: str, experiment_name: str, trial_name: str, create: bool = True) -> Path:
    """``{fileroot}/logs/{user}/{experiment}/{trial}`` (created unless ``create=False``)."""
    path = Path(fileroot) / "logs" / get_user() / experiment_name / trial_name
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def get_checkpoint_path(
    fileroot: str, experiment_name: str, trial_name: str, create: bool = True
) -> Path:
    """``{fileroot}/checkpoints/{user}/{experiment}/{trial}`` (created unless ``create=False``)."""
    path = Path(fileroot) / "checkpoints" / get_user() / experiment_name / trial_name
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path
