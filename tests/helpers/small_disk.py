"""A really small file system for full-disk tests: a tmpfs of a few MiB, unmounted after."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """``mount_point`` (created) holding a tmpfs of ``size`` (e.g. ``"1m"``) while in use.

    Mounting needs root, which this machine and CI have; without it the test fails rather
    than skips, since a full disk is then not tested at all.
    """
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a {size} tmpfs (the test runs as root): {mounted.stderr}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)
