"""A real toy training run whose inference server is SIGKILLed mid-run fails within 60 s,
naming the server, and dispatches no rollout after the death is detected (no livelock)."""

from __future__ import annotations

import getpass
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.infra.rpc.processes import process_alive

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
YAML = REPO / "examples" / "toy" / "toy_grpo.yaml"
DISPATCHED = "dispatched task"
DETECTED = "rollout dispatch stopped"


def _env(root: Path) -> dict[str, str]:
    env = {**os.environ, "AREAL_FILEROOT": str(root), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop(RPC_TOKEN_ENV, None)
    return env


def _inference_servers(root: Path) -> list[tuple[int, str]]:
    """(pid, command line) of the live embedded inference servers of this test's run."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        mine = "areal.inference.server" in cmdline and str(root) in cmdline
        if mine and process_alive(int(entry)):
            found.append((int(entry), cmdline))
    return found


def _flag(cmdline: str, name: str) -> str:
    match = re.search(rf"--{name}[ =](\S+)", cmdline)
    assert match, (name, cmdline)
    return match.group(1)


def test_killing_the_inference_server_fails_the_run_within_60s_naming_it(tmp_path):
    trial_dir = tmp_path / "logs" / getpass.getuser() / "toy-grpo" / "dead"
    main_log, stats = trial_dir / "main.log", trial_dir / "stats.jsonl"
    output = tmp_path / "controller.out"
    command = [
        sys.executable,
        "-m",
        "examples.toy.train",
        "--config",
        str(YAML),
        "trial_name=dead",
        "total_train_epochs=4",
        "total_train_steps=50",  # far more than the run will get to
        "rollout.max_head_offpolicyness=0",  # the trainer waits for step 1's rollouts
        "gconfig.max_new_tokens=48",  # rollouts long enough for the kill to land in them
        "rollout.enable_rollout_tracing=true",
        "rollout.health_check_interval=1",
        "rollout.health_check_timeout=2",
        "rollout.health_check_failures=3",
    ]
    with open(output, "w") as out:
        controller = subprocess.Popen(
            command, cwd=REPO, env=_env(tmp_path), stdout=out, stderr=subprocess.STDOUT
        )
        try:
            # --- wait until step 0 is done: step 1's rollouts now run against the server ---
            deadline = time.monotonic() + 300
            while controller.poll() is None and time.monotonic() < deadline:
                if stats.exists() and stats.read_text().strip():
                    break
                time.sleep(0.05)
            assert controller.poll() is None, output.read_text()[-3000:]
            (pid, cmdline), *others = _inference_servers(tmp_path)
            assert others == []
            address = f"{_flag(cmdline, 'host')}:{_flag(cmdline, 'port')}"

            # --- kill it ---
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            try:
                code = controller.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pytest.fail("the run was still going 120 s after its server was killed")
            elapsed = time.monotonic() - killed
        finally:
            controller.kill()
            controller.wait()

    text = output.read_text(errors="replace")
    assert code != 0, text[-3000:]
    assert elapsed < 60, f"{elapsed:.0f}s"
    # the error says which server died, and on which rollout worker
    named = f"inference server {address} (rollout worker rollout/0) failed"
    assert named in text, text[-3000:]
    # the controller dispatched nothing after it logged the detection (logged under the
    # same lock as each dispatch, so the log order is the real order)
    lines = main_log.read_text(errors="replace").splitlines()
    detected = next(i for i, line in enumerate(lines) if DETECTED in line and named in line)
    assert not any(DISPATCHED in line for line in lines[detected:]), lines[detected:][:20]
