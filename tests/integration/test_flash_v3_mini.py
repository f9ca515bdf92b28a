"""The Flash V3 profile's mini twin, submitted with submit_arena_flash_v3.sh to a real
single-node Slurm cluster, with every mechanism of the profile.

``FLASH_V3_SHAPE=cpu-mini`` runs ``examples/swe/arena_flash_v3_mini.yaml``: a Ling 3 model
(a tiny BailingMoeV3, taught to answer with a Ling 3 ``submit`` tool call), a hybrid
Megatron actor with context parallelism 2 in its attention part and expert parallelism 2 in
its ffn part (``megatron:(attn:d1p1t2c2|ffn:d2p1t1e2)``, four ranks in one Slurm job), two
TP-2 embedded servers forked beside the actor's workers, in-place ``awex`` weight updates
(shared memory on CPU), the ``ling3`` parsers, and two Anthropic-protocol Streams of a
local Arena played by the built-in Claude Code agent. The container binary is the
stand-in (``tests/fakes/container_standin.py``); megatron-core runs on CPU only with the
test shim, so AREAL_PYTHON here starts the worker RPC server through
``tests.unit.engine.megatron_cpu_worker``.

The run: ``--check-arena`` (the controller job alone), then training; after the first step
the controller is SIGKILLed, its worker job ends by itself, and a resubmission with the same
trial name resumes from the recover point and finishes the second step. After each update
every server's log-probs must equal the actor's.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.arena_jobs import local_arena_env, run_entry
from tests.helpers.slurm_jobs import Submission, Watch, assert_no_secret_leaked, submission
from tests.slurm_cluster import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "swe" / "submit_arena_flash_v3.sh"
PROFILE = REPO / "examples" / "swe" / "arena_flash_v3_mini.yaml"
STREAMS = REPO / "examples" / "swe" / "dataset_configs" / "flash-v3-mini-streams.yaml"
EXPERIMENT = "arena-flash-v3-mini"
TOLERANCE = 1e-4  # float32 on CPU agrees to ~1e-6


def megatron_cpu_python(directory: Path) -> Path:
    """An AREAL_PYTHON that is this interpreter, except that the worker RPC server starts
    through the megatron-core CPU shim (production code carries no CPU patches)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "python3-megatron-cpu"  # "python*": forked workers use it too
    path.write_text(
        "#!/bin/bash\n"
        "if [[ ${1:-} == -m && ${2:-} == areal.infra.rpc.rpc_server ]]; then\n"
        "  shift 2\n"
        f'  exec {sys.executable} -m tests.unit.engine.megatron_cpu_worker "$@"\n'
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    path.chmod(0o755)
    return path


def flash_mini_submission(
    tmp_path: Path, cluster: SlurmCluster, arena: tuple[str, str], model: Path
) -> Submission:
    run = submission(tmp_path, cluster, arena, model, PROFILE)
    runtime = tmp_path / "runtime"
    for name in ("awex", "flash-linear-attention"):
        (runtime / name).mkdir(parents=True)
    del run.env["CONFIG_PATH"]  # the shape's default: the mini twin and its Streams
    run.env.update(
        FLASH_V3_SHAPE="cpu-mini",
        AREAL_PYTHON=str(megatron_cpu_python(tmp_path / "bin")),
        ROLLOUT_IMAGE=run.env["AREAL_IMAGE"],
        AWEX_ROOT=str(runtime / "awex"),
        FLASH_LINEAR_ATTENTION_ROOT=str(runtime / "flash-linear-attention"),
    )
    return run


def stats_rows(fileroot: Path, trial: str) -> list[dict]:
    path = next(fileroot.rglob(f"logs/*/{EXPERIMENT}/{trial}/stats.jsonl"), None)
    if path is None:
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def controller_pid(trial: str) -> int | None:
    """The training process of ``trial``'s controller job (python -m ...train_swe_rl)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if b"examples.swe.train_swe_rl" not in cmdline:
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            if f"TRIAL_NAME={trial}".encode() in environ:
                return int(entry)
    return None


def wait_for(what: str, predicate, watch: Watch, timeout: float, log=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s\n{log()[-6000:]}")
        watch.sample()
        time.sleep(1.0)


def check_tool_calls(fileroot: Path, trial: str) -> list[dict]:
    """Every task's audit record. In most tasks the Harness ran (a transcript) and saw the
    policy's Ling 3 ``submit`` call as a tool_use block, which only the proxy's ling3 parser
    makes of the policy's text; the tasks of the killed run that never ran have no
    transcript."""
    records = [
        json.loads(line)
        for shard in sorted((fileroot / EXPERIMENT / trial).rglob("arena_results_*.jsonl"))
        for line in shard.read_text().splitlines()
        if line.strip()
    ]
    ran = [r for r in records if (r.get("raw") or {}).get("transcript")]
    submitted = [
        r
        for r in ran
        if any("submit" in (turn.get("tools") or []) for turn in r["raw"]["transcript"])
    ]
    assert ran and len(submitted) >= len(ran) * 3 // 4, [r.get("raw") for r in records]
    assert {r["status"] for r in submitted} == {"DONE"}, submitted
    return records


def check_colocated_updates(fileroot: Path, trial: str, rows: list[dict], pushes: int) -> None:
    """Both servers were checked against the actor after every update, and every one of the
    ``pushes`` updates went in place: one load per server, handed over by handle for 2 TP
    ranks."""
    log_dir = next(fileroot.rglob(f"logs/*/{EXPERIMENT}/{trial}"))
    logs = [p.read_text() for p in log_dir.glob("*.log") if p.name != "merged.log"]
    loads = sum(text.count("handed over by handle for 2 TP rank(s)") for text in logs)
    assert loads == 2 * pushes, loads
    for row in rows:
        servers = [k for k in row if k.startswith("weight_sync/server")]
        assert len(servers) == 2, row
        for key in servers:
            assert row[key] <= TOLERANCE, (key, row[key])


@pytest.mark.slurm
@pytest.mark.slow
def test_flash_v3_mini_on_slurm_checks_trains_and_resumes_after_sigkill(
    slurm_cluster: SlurmCluster, tmp_path, bailing_tool_model_dir, local_arena
):
    run = flash_mini_submission(tmp_path, slurm_cluster, local_arena, bailing_tool_model_dir)
    watch = Watch(slurm_cluster)

    # 1. --check-arena: the config checks and the Streams' preflight in the controller job
    check_job = run.submit(SCRIPT, "--check-arena", trial="check")
    watch.until_idle(timeout=180)
    log = run.controller_log("check", check_job)
    report = json.loads((run.fileroot / "submissions" / "check" / "preflight.json").read_text())
    assert [s["name"] for s in report["streams"]] == [
        "arith_claude_code",
        "arith_length_claude_code",
    ], log
    assert set(watch.jobs) == {check_job}, watch.jobs  # no worker job was submitted

    # 2. training; the controller is SIGKILLed once the first step's recover point is written
    first = run.submit(SCRIPT, trial="train")
    wait_for(
        "the first step",
        lambda: len(stats_rows(run.fileroot, "train")) >= 1,
        watch,
        timeout=1200,
        log=lambda: run.controller_log("train", first),
    )
    pid = controller_pid("train")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed = set(watch.sample())
    workers = killed - {first}
    assert workers, watch.jobs  # the actor job (the servers are forked inside it)
    # no cleanup ran in the controller: each worker job's own watcher cancels it
    watch.until_idle(timeout=180)
    worker_output = "\n".join(
        p.read_text(errors="replace")
        for p in next(run.fileroot.rglob(f"logs/*/{EXPERIMENT}/train")).glob("*.log")
    )
    assert f"controller job {first} has ended" in worker_output

    # 3. the resubmission resumes at step 1 and finishes
    second = run.submit(SCRIPT, trial="train")
    watch.until_idle(timeout=1200)
    log = run.controller_log("train", second)
    assert "recovered: resuming at global step 1" in log, log[-6000:]
    rows = stats_rows(run.fileroot, "train")
    assert [r["global_step"] for r in rows] == [0, 1], log[-6000:]
    for version, row in enumerate(rows, start=1):
        assert row["train/weight_version"] == float(version)
        assert row["ppo_actor/n_seqs"] == 4.0  # batch 2 prompts x 2 samples
    # one push per step, and one after the recover point was loaded
    check_colocated_updates(run.fileroot, "train", rows, pushes=len(rows) + 1)
    records = check_tool_calls(run.fileroot, "train")
    assert {r.get("stream_id") for r in records} == {"arith-claude-code", "arith-length"}
    actor_log = next(run.fileroot.rglob(f"logs/*/{EXPERIMENT}/train/actor.log")).read_text()
    assert "context_parallel_size=2, expert_parallel_size=2" in actor_log
    assert slurm_cluster.job_ids() == []
    assert_no_secret_leaked(run, watch, slurm_cluster)


@pytest.mark.gpu
@pytest.mark.slow
def test_flash_v3_mini_trains_one_step_with_megatron_on_one_gpu(tmp_path, tiny_model_dir):
    # one GPU: one actor rank and one server forked onto it, updated in place by CUDA IPC;
    # the local scheduler and the in-process local Arena
    env = local_arena_env(
        tmp_path,
        tiny_model_dir,
        "admin-" + os.urandom(8).hex(),
        ACTOR_BACKEND="megatron:d1p1t1",
        ROLLOUT_BACKEND="hf:d1",
        DATASET_CONFIG=str(STREAMS),
        TOTAL_TRAIN_STEPS="1",
        AREAL_DIR=str(REPO),
        AREAL_PYTHON=sys.executable,
        AREAL_IMAGE="unused",
        ROLLOUT_IMAGE="unused",
        AWEX_ROOT=str(tmp_path),
        FLASH_LINEAR_ATTENTION_ROOT=str(tmp_path),
    )
    overrides = [
        "scheduler.type=local",
        "econfig.arena_base_url=local",
        "cluster.n_gpus_per_node=1",
        "actor.scheduling_spec.0.gpu=1",
        "actor.dtype=bfloat16",
        "sglang.dtype=bfloat16",
        "actor.weight_sync_check_tolerance=0.5",
        "actor.megatron.ddp.use_distributed_optimizer=true",
    ]
    run_entry(
        "examples.swe.train_swe_rl", ["--config", str(PROFILE), *overrides], env, timeout=1500
    )
    log_dir = tmp_path / "logs" / getpass.getuser() / EXPERIMENT / "mini"
    rows = [json.loads(x) for x in (log_dir / "stats.jsonl").read_text().splitlines() if x]
    assert [r["global_step"] for r in rows] == [0]
    assert rows[0]["weight_sync/server0_max_abs_logp_diff"] <= 0.5
    assert "handed over by handle for 1 TP" in (log_dir / "rollout.log").read_text()
