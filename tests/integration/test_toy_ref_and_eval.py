"""The toy example with the default KL penalty (a reference model) and evaluation.

One run of ``examples.toy.train`` (local scheduler, embedded ``hf`` server, FSDP on gloo)
from a copy of ``toy_grpo.yaml`` without its ``actor.kl_ctl`` line, so the default 0.1
applies: the trainer forks a frozen ref beside the actor, and the KL term scores the
behaviour log-probs against it (0 at the first step, a penalty after), never against 0,
which would be a per-token bonus of ``-0.1 x logp`` (about +0.6 for this model).
Evaluation runs every 2 steps and once before training, under ``eval-rollout/``.
"""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal.api.scheduler_api import RPC_TOKEN_ENV

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
YAML = REPO / "examples" / "toy" / "toy_grpo.yaml"


def test_default_kl_ctl_trains_against_a_ref_and_eval_runs_every_two_steps(tmp_path):
    config = tmp_path / "toy_default_kl.yaml"
    lines = YAML.read_text().splitlines()
    config.write_text("\n".join(line for line in lines if "kl_ctl" not in line) + "\n")
    env = {**os.environ, "AREAL_FILEROOT": str(tmp_path / "root"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop(RPC_TOKEN_ENV, None)
    command = [sys.executable, "-m", "examples.toy.train", "--config", str(config)]
    command += [
        "trial_name=refeval",
        "total_train_steps=4",
        "evaluator.freq_steps=2",
        "evaluator.eval_before_train=true",
    ]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ref: 1 rank(s) ready" in done.stderr + done.stdout

    trial = tmp_path / "root" / "logs" / getpass.getuser() / "toy-grpo" / "refeval"
    rows = [json.loads(x) for x in (trial / "stats.jsonl").read_text().splitlines() if x]
    assert [r["global_step"] for r in rows] == [0, 1, 2, 3]

    # --- KL against the ref: zero while the policy is the ref, a penalty (< 0) after ---
    assert all("timeperf/ref_logp" in r for r in rows)
    assert abs(rows[0]["ppo_actor/kl_rewards/avg"]) < 1e-3
    assert all(r["ppo_actor/kl_rewards/avg"] < 0.01 for r in rows)

    # --- evaluation: before training, then after steps 2 and 4 (global steps 1 and 3) ---
    evaluated = [r["global_step"] for r in rows if "eval-rollout/reward_mean" in r]
    assert evaluated == [1, 3]
    assert rows[0]["eval-rollout/before_train/n_rows"] == 8.0
    assert "eval-rollout/before_train/reward_mean" in rows[0]
    for r in (rows[1], rows[3]):
        assert r["eval-rollout/n_rows"] == 8.0 and r["eval-rollout/n_rejected"] == 0.0
        assert r["eval-rollout/n_samples"] == 8.0  # eval_gconfig.n_samples 1, greedy
        assert 0.0 <= r["eval-rollout/reward_mean"] <= 1.0
    # each controller counts its own groups: 4 training prompts a step; 8 valid rows an eval
    assert rows[3]["rollout/accepted_total"] == 16.0
    assert rows[3]["eval-rollout/accepted_total"] == 24.0
