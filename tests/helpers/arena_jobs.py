"""Runs the Arena entry points as a user would: a subprocess against the local Arena."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from areal.api.scheduler_api import RPC_TOKEN_ENV

REPO = Path(__file__).resolve().parents[2]

# Real Arena credentials (and a controller's RPC token) must not leak in from the caller.
INHERITED_SECRETS = (
    "ARENA_OPENAPI_BASE",
    "ARENA_OPENAPI_TOKEN",
    "ARENA_LLM_API_KEY",
    RPC_TOKEN_ENV,
)


def local_arena_env(root: Path, model: Path, admin_key: str, **extra: str) -> dict[str, str]:
    """The caller's environment plus what the local profiles read, minus inherited secrets."""
    env = {
        **os.environ,
        "AREAL_FILEROOT": str(root),
        "MODEL_PATH": str(model),
        "SWE_RL_ADMIN_API_KEY": admin_key,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **extra,
    }
    for name in INHERITED_SECRETS:
        env.pop(name, None)
    return env


def run_entry(module: str, args: list[str], env: dict[str, str], *, timeout: float) -> str:
    """``python -m module args`` from the repository root; asserts exit 0 and that the admin
    key never reached the output, and returns stdout + stderr."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert env["SWE_RL_ADMIN_API_KEY"] not in output
    return output
