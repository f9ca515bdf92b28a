"""The scaled-down Flash V3 profile trains through ``PPOTrainer`` with every mechanism.

``examples/swe/arena_flash_v3_mini.yaml`` inherits arena_flash_v3.yaml's recipe and keeps
its mechanisms at the smallest size: a Ling 3 model (the tiny BailingMoeV3), a hybrid
Megatron actor with context parallelism 2 in its attention part and expert parallelism 2 in
its ffn part (``megatron:(attn:d1p1t2c2|ffn:d2p1t1e2)``, on CPU through the test shim), two
TP-2 servers colocated by fork on the actor's four ranks, in-place ``awex`` weight updates
(shared memory on CPU), the ``ling3`` parsers and two Anthropic-protocol Streams with pinned
Harness and reward refs. After each update every server's log-probs must equal the actor's.
"""

from __future__ import annotations

import getpass
import json
import math
import secrets
import sys
from pathlib import Path

import pytest

from tests.helpers.arena_jobs import local_arena_env, run_entry

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "examples" / "swe" / "arena_flash_v3_mini.yaml"


def run_mini(root: Path, model: Path, *overrides: str, **env: str) -> tuple[str, list[dict]]:
    env = local_arena_env(root, model, secrets.token_urlsafe(24), **env)
    args = ["--config", str(PROFILE), *overrides]
    output = run_entry("examples.swe.train_swe_rl", args, env, timeout=1500)
    log_dir = root / "logs" / getpass.getuser() / "arena-flash-v3-mini" / "mini"
    stats = [
        json.loads(line)
        for line in (log_dir / "stats.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return output, stats


def log_dir_of(root: Path) -> Path:
    return root / "logs" / getpass.getuser() / "arena-flash-v3-mini" / "mini"


def check_colocated(root: Path, stats: list[dict], sync_tolerance: float, tp: int) -> None:
    """Each server's rollout worker was forked beside an actor worker (the first of its TP
    group), its memory released around every training phase, and every update went in
    place, one entry per TP rank; then every server served the actor's weights."""
    log_dir = log_dir_of(root)
    n_workers = (log_dir / "actor.log").read_text().count("Forked rollout/")
    assert n_workers >= 1
    loads = (log_dir / "rollout.log").read_text().count(f"handed over by handle for {tp} TP")
    assert loads == n_workers * len(stats), (loads, n_workers)
    for step in stats:
        assert "timeperf/offload_rollout" in step and "timeperf/onload_rollout" in step
        servers = [k for k in step if k.startswith("weight_sync/server")]
        assert len(servers) == n_workers, step
        for key in servers:
            assert step[key] <= sync_tolerance, (key, step[key])


def check_steps(root: Path, stats: list[dict], steps: int, tp: int, tolerance: float) -> None:
    """``tolerance``: float32 on CPU agrees to ~1e-6; bfloat16 on a GPU much less."""
    assert [s["global_step"] for s in stats] == list(range(steps))
    check_colocated(root, stats, tolerance, tp)
    for version, step in enumerate(stats, start=1):
        assert step["train/weight_version"] == float(version)
        # outcome-only GRPO: a batch whose groups each got one reward for every sample (the
        # exact-match Stream scores a random model 0) has zero advantages and no gradient
        flat = step["ppo_actor/advantages/min"] == step["ppo_actor/advantages/max"] == 0.0
        assert step["ppo_actor/grad_norm"] > 0.0 or flat, step
        assert math.isfinite(step["ppo_actor/grad_norm"])
        assert step["ppo_actor/n_seqs"] == 4.0  # batch 2 prompts x 2 samples
    records = [
        json.loads(line)
        for shard in sorted((root / "arena-flash-v3-mini" / "mini").rglob("arena_results_*.jsonl"))
        for line in shard.read_text().splitlines()
        if line.strip()
    ]
    assert len(records) >= 4 * steps
    # both Streams ran (equal weights), over the Anthropic protocol
    assert {r.get("stream_id") for r in records} >= {"arith-claude-code", "arith-length"}, [
        r.get("stream_id") for r in records
    ]
    statuses = [r["status"] for r in records]
    assert set(statuses) <= {"DONE", "OK", "NO_OUTPUT", "HARNESS_FAILED", "LOCAL_WAIT_CANCELLED"}
    assert statuses.count("DONE") + statuses.count("OK") > 0, statuses


def test_flash_v3_mini_trains_two_steps_with_every_mechanism_on_cpu(tmp_path, bailing_model_dir):
    """The profile's mechanisms together through PPOTrainer: Ling 3, Megatron c2 | e2 on four
    ranks, two colocated TP-2 servers updated in place. megatron-core runs on CPU only with
    the test shim (``tests.unit.engine.megatron_cpu_worker``); its distributed optimizer
    needs CUDA buffers, so it is off here."""
    worker = f"{sys.executable} -m tests.unit.engine.megatron_cpu_worker"
    _, stats = run_mini(
        tmp_path,
        bailing_model_dir,
        "total_train_steps=2",
        "actor.dtype=float32",
        "actor.megatron.ddp.use_distributed_optimizer=false",
        f"actor.scheduling_spec.0.cmd={worker}",
    )
    check_steps(tmp_path, stats, steps=2, tp=2, tolerance=1e-4)
    actor_log = (log_dir_of(tmp_path) / "actor.log").read_text()
    assert "tensor_parallel_size=2" in actor_log  # Megatron engine ready
    assert "context_parallel_size=2, expert_parallel_size=2" in actor_log


@pytest.mark.gpu
def test_flash_v3_mini_trains_one_step_with_megatron(tmp_path, tiny_model_dir):
    # one GPU: one actor rank and one server forked onto it, updated in place by CUDA IPC
    _, stats = run_mini(
        tmp_path, tiny_model_dir, "rollout.backend=hf:d1", ACTOR_BACKEND="megatron:d1p1t1"
    )
    check_steps(tmp_path, stats, steps=1, tp=1, tolerance=0.5)
    actor_log = (log_dir_of(tmp_path) / "actor.log").read_text()
    assert "Megatron engine ready" in actor_log
