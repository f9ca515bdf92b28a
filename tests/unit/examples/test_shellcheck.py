"""The submit scripts stay shellcheck clean (skips where shellcheck is not installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[3] / "examples" / "swe").glob("*.sh"))


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script):
    done = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_submit_scripts_exist():
    assert {p.name for p in SCRIPTS} >= {"submit_arena.sh", "submit_arena_flash_v3.sh"}
