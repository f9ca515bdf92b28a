"""The scaled-down Flash V3 profile trains through ``PPOTrainer`` at its topology.

``examples/swe/arena_flash_v3_mini.yaml`` inherits arena_flash_v3.yaml's training recipe
(decoupled PPO loss with token-level rejection sampling, length-adaptive GAE lambda,
reward clipping, the SWE message preprocessors and prefix matcher) and its shape: two
actor ranks, and rollout colocated on the actor's workers by fork, one server forked onto
each actor worker, whose memory is released while the actor trains. On a GPU machine the
actor is Megatron (``megatron:d1p1t2``, the profile's default), here on CPU through the
test shim; ``ACTOR_BACKEND=fsdp:d2`` runs the same profile where megatron-core cannot.
"""

from __future__ import annotations

import getpass
import json
import secrets
import sys
from pathlib import Path

import pytest

from tests.helpers.arena_jobs import local_arena_env, run_entry

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "examples" / "swe" / "arena_flash_v3_mini.yaml"


def run_mini(root: Path, model: Path, backend: str, *overrides: str) -> tuple[str, list[dict]]:
    env = local_arena_env(root, model, secrets.token_urlsafe(24), ACTOR_BACKEND=backend)
    # the mini's Stream is length-scored: rewards differ within a group, so the
    # group-normalized advantages (and the gradient) are not 0 even for a random model
    args = ["--config", str(PROFILE), *overrides]
    output = run_entry("examples.swe.train_swe_rl", args, env, timeout=900)
    log_dir = root / "logs" / getpass.getuser() / "arena-flash-v3-mini" / "mini"
    stats = [
        json.loads(line)
        for line in (log_dir / "stats.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return output, stats


def check_colocated(root: Path, stats: list[dict], sync_tolerance: float) -> None:
    """Each rollout worker was forked onto an actor worker; servers gave memory back."""
    log_dir = root / "logs" / getpass.getuser() / "arena-flash-v3-mini" / "mini"
    actor_log = (log_dir / "actor.log").read_text()
    n_workers = actor_log.count("Forked rollout/")
    assert n_workers >= 1 and n_workers == len(
        [k for k in stats[0] if k.startswith("weight_sync/server")]
    ), actor_log[-2000:]
    for step in stats:  # around every training phase
        assert "timeperf/offload_rollout" in step and "timeperf/onload_rollout" in step
        # after the (disk) update both colocated servers serve the actor's weights
        servers = [k for k in step if k.startswith("weight_sync/server")]
        assert servers, step
        for key in servers:
            assert step[key] <= sync_tolerance, (key, step[key])


def check_one_step(root: Path, stats: list[dict], sync_tolerance: float = 1e-4) -> None:
    """``sync_tolerance``: float32 on CPU agrees to ~1e-5; bfloat16 on a GPU much less."""
    assert [s["global_step"] for s in stats] == [0]
    check_colocated(root, stats, sync_tolerance)
    step = stats[0]
    assert step["train/weight_version"] == 1.0  # the step's weights reached the rollout side
    assert step["ppo_actor/optimizer_steps"] == 1.0
    assert step["ppo_actor/grad_norm"] > 0.0 and step["ppo_actor/advantages/avg"] != 0.0
    assert step["ppo_actor/n_seqs"] == 4.0  # batch 2 prompts x 2 samples
    records = [
        json.loads(line)
        for shard in sorted((root / "arena-flash-v3-mini" / "mini").rglob("arena_results_*.jsonl"))
        for line in shard.read_text().splitlines()
        if line.strip()
    ]
    # one record per Arena task: the step's 4, plus any launched ahead (off-policyness 1)
    assert len(records) >= 4
    # NO_OUTPUT is a model outcome (a random tiny model may sample end-of-turn first);
    # rollouts launched ahead and cancelled when the run ends are audited as such, with
    # neither an Arena score nor a training score
    statuses = [r["status"] for r in records]
    assert set(statuses) <= {"DONE", "OK", "NO_OUTPUT", "LOCAL_WAIT_CANCELLED"}, statuses
    assert statuses.count("DONE") + statuses.count("OK") > 0, statuses
    for record in records:
        if record["status"] == "LOCAL_WAIT_CANCELLED":
            assert record["arena_score"] is None and record["training_score"] is None
    # every task ended in Arena; a launched-ahead rollout cancelled at the run's end counts as
    # unfinished, and lowers this mean when it is cancelled before the step's export
    if "LOCAL_WAIT_CANCELLED" not in statuses:
        assert step["rollout/arena/terminal_success"] == 1.0
    assert step["rollout/arena/terminal_success"] > 0.5


def test_flash_v3_mini_trains_one_step_with_megatron_tp2_on_cpu(tmp_path, tiny_model_dir):
    """The profile's own actor, Megatron with two tensor-parallel ranks, through PPOTrainer.

    megatron-core runs on CPU only with the test shim, which the actor workers load
    (``tests.unit.engine.megatron_cpu_worker``); its distributed optimizer needs CUDA
    buffers, so it is off here (the GPU test below keeps it).
    """
    worker = f"{sys.executable} -m tests.unit.engine.megatron_cpu_worker"
    _, stats = run_mini(
        tmp_path,
        tiny_model_dir,
        "megatron:d1p1t2",
        "actor.dtype=float32",
        "actor.megatron.ddp.use_distributed_optimizer=false",
        f"actor.scheduling_spec.0.cmd={worker}",
    )
    check_one_step(tmp_path, stats)
    log_dir = tmp_path / "logs" / getpass.getuser() / "arena-flash-v3-mini" / "mini"
    assert "tensor_parallel_size=2" in (log_dir / "actor.log").read_text()


@pytest.mark.gpu
def test_flash_v3_mini_trains_one_step_with_megatron(tmp_path, tiny_model_dir):
    # one GPU: one actor rank and one server forked onto it (t2 needs two GPUs)
    _, stats = run_mini(tmp_path, tiny_model_dir, "megatron:d1p1t1", "rollout.backend=hf:d1")
    check_one_step(tmp_path, stats, sync_tolerance=0.5)
    actor_log = tmp_path / "logs" / getpass.getuser() / "arena-flash-v3-mini" / "mini" / "actor.log"
    assert "Megatron engine ready" in actor_log.read_text()
