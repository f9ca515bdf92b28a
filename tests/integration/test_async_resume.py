"""Exact resume in asynchronous mode: a toy run with ``max_head_offpolicyness=1`` is
SIGKILLed after step 2 while rows are drawn ahead of training, then rerun with the same
experiment and trial names; over the whole epoch every row is trained exactly once.

(``test_trainer_e2e.py::test_sigkill_after_step_two_resumes_at_step_three`` is the
synchronous version.)
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.infra.rpc.processes import process_alive

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
YAML = REPO / "examples" / "toy" / "toy_grpo.yaml"
BATCH = 16  # the toy dataset has 64 rows: one epoch is 4 steps
OVERRIDES = (
    f"train_dataset.batch_size={BATCH}",
    "gconfig.n_samples=2",
    "total_train_steps=4",
    "rollout.max_head_offpolicyness=1",
)


def _env(root: Path) -> dict[str, str]:
    env = {**os.environ, "AREAL_FILEROOT": str(root), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop(RPC_TOKEN_ENV, None)
    return env


def _command(trial: str) -> list[str]:
    config = ["--config", str(YAML), f"trial_name={trial}", *OVERRIDES]
    return [sys.executable, "-m", "examples.toy.train", *config]


def _processes_of(root: Path) -> list[int]:
    """Live processes whose command line mentions ``root`` (workers, servers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(root) in cmdline and process_alive(int(entry)):
            found.append(int(entry))
    return found


def _trial_dir(root: Path, trial: str) -> Path:
    return root / "logs" / getpass.getuser() / "toy-grpo" / trial


def _trained_prompts(root: Path, trial: str) -> dict[int, list[str]]:
    """The prompt of each group every step trained, from the trainer's ``trained.jsonl``.

    A step run again after the resume appends another line for it: the last line of each
    step is what that step trained in the run that reached the end.
    """
    path = _trial_dir(root, trial) / "rollout" / "trained.jsonl"
    by_step: dict[int, list[str]] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        by_step[entry["global_step"]] = [group["prompt"] for group in entry["groups"]]
    return by_step


def _dataset_prompts(root: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every row of the toy dataset, decoded as the dumps decode prompts."""
    from transformers import AutoTokenizer

    from areal.api.cli_args import GRPOConfig, load_expr_config
    from examples.toy.train import build_inputs

    monkeypatch.setenv("AREAL_FILEROOT", str(root))
    config, _ = load_expr_config(
        ["--config", str(YAML), "trial_name=dataset", *OVERRIDES], GRPOConfig
    )
    dataset, _, _ = build_inputs(config)
    tokenizer = AutoTokenizer.from_pretrained(config.actor.path)
    return [tokenizer.decode(row["input_ids"], skip_special_tokens=False) for row in dataset]


def test_sigkill_in_async_mode_then_rerun_trains_every_row_once(tmp_path, monkeypatch):
    stats = _trial_dir(tmp_path, "async") / "stats.jsonl"
    controller = subprocess.Popen(
        _command("async"),
        cwd=REPO,
        env=_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while controller.poll() is None and time.monotonic() < deadline:
            if stats.exists() and len(stats.read_text().splitlines()) >= 2:
                break
            time.sleep(0.05)
        assert controller.poll() is None, "the run ended before step 2 was logged"
        controller.send_signal(signal.SIGKILL)
        controller.wait()
    finally:
        controller.kill()
    info = next((tmp_path / "checkpoints").rglob("recover_info"))
    saved_step = json.loads((info / "step_info.json").read_text())["global_step"]
    outstanding = json.loads((info / "dataloader_info.json").read_text())["outstanding"]
    assert saved_step in (1, 2)
    assert outstanding, "no row was drawn ahead at the recover point; the test proves nothing"

    deadline = time.monotonic() + 45  # the killed run's workers stop on their own
    while _processes_of(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_of(tmp_path) == []
    done = subprocess.run(
        _command("async"), cwd=REPO, env=_env(tmp_path), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resuming at global step {saved_step + 1}" in done.stdout + done.stderr

    steps = [json.loads(line)["global_step"] for line in stats.read_text().splitlines()]
    assert steps == sorted(set(steps)) and {0, 1, 3} <= set(steps)  # no step logged twice
    by_step = _trained_prompts(tmp_path, "async")
    assert sorted(by_step) == [0, 1, 2, 3]
    assert all(len(prompts) == BATCH for prompts in by_step.values())
    trained = Counter(p for prompts in by_step.values() for p in prompts)
    expected = _dataset_prompts(tmp_path, monkeypatch)
    assert len(set(expected)) == len(expected) == 64
    assert trained == Counter(expected)  # every row of the epoch, exactly once
