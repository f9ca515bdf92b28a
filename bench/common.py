"""Helpers the benchmark scripts share."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from areal.utils.network import wait_healthy

ROOT = Path(__file__).resolve().parents[1]


def start_service(
    name: str, argv: list[str], port: int, env: dict | None = None, timeout: float = 300.0
) -> subprocess.Popen:
    """Start ``argv`` from the repository root; return once ``/health`` on ``port`` is 200."""
    process = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **(env or {})})
    try:
        wait_healthy(f"127.0.0.1:{port}", process, timeout=timeout, what=name)
    except BaseException:
        process.kill()
        raise
    return process
