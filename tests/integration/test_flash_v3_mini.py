"""The scaled-down Flash V3 profile trains one step through ``PPOTrainer``.

``examples/swe/arena_flash_v3_mini.yaml`` inherits arena_flash_v3.yaml's training recipe
(decoupled PPO loss with token-level rejection sampling, length-adaptive GAE lambda,
reward clipping, the SWE message preprocessors and prefix matcher, rollout forked onto the
actor's workers) and shrinks the rest to one machine with a local Arena. On a GPU machine
the actor is Megatron (``megatron:d1p1t1``, the profile's default); on CPU the same profile
runs with ``ACTOR_BACKEND=fsdp:d1`` since megatron-core needs CUDA in a worker process.
"""

from __future__ import annotations

import getpass
import json
import secrets
from pathlib import Path

import pytest

from tests.helpers.arena_jobs import local_arena_env, run_entry

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "examples" / "swe" / "arena_flash_v3_mini.yaml"


def run_mini(root: Path, model: Path, backend: str, *overrides: str) -> tuple[str, list[dict]]:
    env = local_arena_env(root, model, secrets.token_urlsafe(24), ACTOR_BACKEND=backend)
    # A random tiny model scores 0 on every task, and the recipe normalizes nothing, so the
    # advantages (and the gradient) would be 0: a reward bias makes the step move weights.
    args = ["--config", str(PROFILE), "actor.reward_bias=-0.5", *overrides]
    output = run_entry("examples.swe.train_swe_rl", args, env, timeout=900)
    log_dir = root / "logs" / getpass.getuser() / "arena-flash-v3-mini" / "mini"
    stats = [
        json.loads(line)
        for line in (log_dir / "stats.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return output, stats


def check_one_step(root: Path, stats: list[dict]) -> None:
    assert [s["global_step"] for s in stats] == [0]
    step = stats[0]
    assert step["train/weight_version"] == 1.0  # the step's weights reached the rollout side
    assert step["ppo_actor/optimizer_steps"] == 1.0
    assert step["ppo_actor/grad_norm"] > 0.0 and step["ppo_actor/advantages/avg"] != 0.0
    assert step["ppo_actor/n_seqs"] == 4.0  # batch 2 prompts x 2 samples
    assert step["rollout/arena/terminal_success"] == 1.0
    records = [
        json.loads(line)
        for shard in sorted((root / "arena-flash-v3-mini" / "mini").rglob("arena_results_*.jsonl"))
        for line in shard.read_text().splitlines()
        if line.strip()
    ]
    # one record per Arena task: the step's 4, plus any launched ahead (off-policyness 1)
    assert len(records) >= 4
    # NO_OUTPUT is a model outcome (a random tiny model may sample end-of-turn first)
    statuses = [r["status"] for r in records]
    assert set(statuses) <= {"DONE", "OK", "NO_OUTPUT"}, statuses
    assert statuses.count("DONE") + statuses.count("OK") > 0, statuses


def test_flash_v3_mini_trains_one_step_on_cpu(tmp_path, tiny_model_dir):
    _, stats = run_mini(tmp_path, tiny_model_dir, "fsdp:d1", "actor.dtype=float32")
    check_one_step(tmp_path, stats)


@pytest.mark.gpu
def test_flash_v3_mini_trains_one_step_with_megatron(tmp_path, tiny_model_dir):
    _, stats = run_mini(tmp_path, tiny_model_dir, "megatron:d1p1t1")
    check_one_step(tmp_path, stats)
    actor_log = tmp_path / "logs" / getpass.getuser() / "arena-flash-v3-mini" / "mini" / "actor.log"
    assert "Megatron engine ready" in actor_log.read_text()
