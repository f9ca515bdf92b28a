"""Standard locations under ``cluster.fileroot``, and the names that may become path parts."""

from __future__ import annotations

import getpass
import os
import re
from pathlib import Path

__all__ = [
    "MAX_NAME_LENGTH",
    "check_path_name",
    "get_checkpoint_path",
    "get_log_path",
    "get_user",
    "make_private_dirs",
    "path_name_problem",
]

MAX_NAME_LENGTH = 128
# Letters, digits and "_.+=@-", not starting with "." or "-": never "..", a hidden file or
# something a command line reads as an option; no "/" or NUL, so always one path part.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=@-]*")


def path_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be one part of a path (``None`` when it can)."""
    if not isinstance(name, str):
        return f"must be a string, got {type(name).__name__}"
    if not name:
        return "must not be empty"
    if "\0" in name:
        return "must not contain a NUL character"
    if "/" in name or "\\" in name:
        return f"{name!r} must not contain '/' or '\\' (it becomes one directory or file name)"
    if ".." in name:
        return f"{name!r} must not contain '..'"
    if len(name) > MAX_NAME_LENGTH:
        return f"must be at most {MAX_NAME_LENGTH} characters (got {len(name)})"
    if not _NAME.fullmatch(name):
        return (
            f"{name!r} may only contain letters, digits and '_.+=@-', and must start with a "
            "letter, a digit or '_'"
        )
    return None


def check_path_name(name: str, what: str) -> str:
    """``name`` if it is safe as one part of a path; ``ValueError`` naming ``what`` if not."""
    problem = path_name_problem(name)
    if problem is not None:
        raise ValueError(f"{what}: {problem}")
    return name


def make_private_dirs(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and any missing parents with mode 0700; existing ones are left alone."""
    target = Path(path)
    missing = []
    current = target
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:  # created concurrently (another rank, another worker)
            if not directory.is_dir():
                raise
    if not target.is_dir():
        raise NotADirectoryError(f"{target} is not a directory")
    return target


def get_user() -> str:
    """Login name of the process owner (falls back to ``$USER`` or the uid)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return os.environ.get("USER") or str(os.getuid())


def _trial_dir(fileroot: str, kind: str, experiment_name: str, trial_name: str) -> Path:
    check_path_name(experiment_name, "experiment_name")
    check_path_name(trial_name, "trial_name")
    return Path(fileroot) / kind / get_user() / experiment_name / trial_name


def get_log_path(fileroot: str, experiment_name: str, trial_name: str, create: bool = True) -> Path:
    """``{fileroot}/logs/{user}/{experiment}/{trial}`` (created unless ``create=False``).

    Both names must be single path parts (see :func:`path_name_problem`). The directories
    from ``{user}`` down are created with mode 0700 (they hold config snapshots and logs);
    ``{fileroot}/logs`` itself is shared by every user and keeps the default mode.
    """
    path = _trial_dir(fileroot, "logs", experiment_name, trial_name)
    if create:
        (Path(fileroot) / "logs").mkdir(parents=True, exist_ok=True)
        make_private_dirs(path)
    return path


def get_checkpoint_path(
    fileroot: str, experiment_name: str, trial_name: str, create: bool = True
) -> Path:
    """``{fileroot}/checkpoints/{user}/{experiment}/{trial}`` (created unless ``create=False``).

    Both names must be single path parts (see :func:`path_name_problem`).
    """
    path = _trial_dir(fileroot, "checkpoints", experiment_name, trial_name)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path
