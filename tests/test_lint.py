"""The code base is ruff clean (lint and format), so CI enforces the style rules."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=REPO_ROOT, capture_output=True, text=True
    )


def test_ruff_check_is_clean():
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr
