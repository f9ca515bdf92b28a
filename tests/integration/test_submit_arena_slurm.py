"""``submit_arena.sh`` on a real single-node Slurm cluster against a local Arena.

Cluster in a box: ``examples/swe/arena_grpo_mini.yaml``, arena_grpo's mini twin at its own
topology (an ``fsdp:d2`` actor, two rollout servers of TP 2, ``xccl`` weight sync over
gloo, the ``session_gateway`` route mode), submitted exactly as on a cluster. The
container binary is the stand-in (``tests/fakes/container_standin.py``): it records argv
and binds and runs the command on the host. The controller job submits the worker jobs
through ``SlurmScheduler`` and trains two steps; after each step's weight update both
servers' greedy log-probs must equal the actor's on the same tokens
(``actor.weight_sync_check``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.slurm_jobs import Watch, assert_no_secret_leaked, submission
from tests.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "swe" / "submit_arena.sh"
MINI_PROFILE = REPO / "examples" / "swe" / "arena_grpo_mini.yaml"


def test_arena_grpo_mini_twin_trains_two_steps_on_slurm(
    slurm_cluster: SlurmCluster, tmp_path, tiny_model_dir, local_arena
):
    run = submission(tmp_path, slurm_cluster, local_arena, tiny_model_dir, MINI_PROFILE)
    run.env["ARENA_STREAM_ID"] = "arith-length"  # length-scored: rewards differ within a group
    fileroot = run.fileroot
    watch = Watch(slurm_cluster)

    # 1. --check-arena: the controller job validates and runs preflight, nothing more
    check_job = run.submit(SCRIPT, "--check-arena", trial="check")
    watch.until_idle(timeout=180)
    log = run.controller_log("check", check_job)
    report = json.loads((fileroot / "submissions" / "check" / "preflight.json").read_text())
    assert report, log
    assert all(r.get("ok", True) for r in (report if isinstance(report, list) else [report])), (
        report
    )
    assert set(watch.jobs) == {check_job}, watch.jobs  # no worker job was submitted

    # 2. the full run: the controller submits worker jobs and trains two steps
    train_job = run.submit(SCRIPT, trial="train")
    watch.until_idle(timeout=600)
    controller_log = run.controller_log("train", train_job)
    stats = next(fileroot.rglob("arena-grpo-mini/train/stats.jsonl"), None)
    assert stats is not None, controller_log[-4000:]
    rows = [json.loads(x) for x in stats.read_text().splitlines() if x.strip()]
    assert [r["global_step"] for r in rows] == [0, 1], controller_log[-4000:]
    for row in rows:
        assert row["train/weight_version"] == row["global_step"] + 1
        # both servers, after this step's update, against the actor (tolerance 1e-4 is
        # also enforced by the run itself, which would have failed)
        for server in (0, 1):
            assert row[f"weight_sync/server{server}_max_abs_logp_diff"] <= 1e-4, row
        assert row["ppo_actor/n_seqs"] == 4.0  # 2 prompts x 2 samples
    assert any(row["ppo_actor/grad_norm"] > 0 for row in rows), rows  # weights did move
    worker_jobs = set(watch.jobs) - {check_job, train_job}
    assert len(worker_jobs) >= 2, watch.jobs  # actor and rollout roles ran as their own jobs
    scripts = "\n".join(watch.jobs[j] for j in worker_jobs)
    assert "--role actor" in scripts and "--role rollout" in scripts
    # the embedded servers joined the weight-update group with 2 ranks each
    assert sum("--tp-size 2" in a.replace("\0", " ") for a in watch.argv) >= 2, watch.argv
    assert slurm_cluster.job_ids() == []

    # 3. secrets: in no job script, scontrol output, argv, log or report
    assert_no_secret_leaked(run, watch, slurm_cluster)
