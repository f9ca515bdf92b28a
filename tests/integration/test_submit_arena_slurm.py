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

import contextlib
import json
import os
import secrets
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "swe" / "submit_arena.sh"
STANDIN = REPO / "tests" / "fakes" / "container_standin.py"
MINI_PROFILE = REPO / "examples" / "swe" / "arena_grpo_mini.yaml"


@pytest.fixture
def local_arena(tmp_path):
    """A local Arena server process on loopback; yields (base URL, token)."""
    from areal.utils.network import find_free_port, wait_healthy

    port = find_free_port()
    db = tmp_path / "arena" / "arena.db"
    db.parent.mkdir()
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "examples.swe.local_arena", "serve"),
            *("--host", "127.0.0.1", "--port", str(port), "--db", str(db)),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"127.0.0.1:{port}", process, timeout=60, what="local Arena")
        token_file = Path(f"{db}.token")
        yield f"http://127.0.0.1:{port}", token_file.read_text().strip()
    finally:
        process.terminate()
        process.wait(timeout=30)


class Watch:
    """What Slurm shows about every job while the run goes on, and every process argv."""

    def __init__(self, cluster: SlurmCluster):
        self.cluster = cluster
        self.jobs: dict[str, str] = {}  # job id -> scontrol show job + batch script
        self.argv: set[str] = set()

    def sample(self) -> list[str]:
        ids = self.cluster.job_ids()
        for job in ids:
            shown = self.cluster.client("scontrol", "show", "job", "--details", job, check=False)
            script = self.cluster.client("scontrol", "write", "batch_script", job, "-", check=False)
            self.jobs[job] = shown.stdout + script.stdout
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                    self.argv.add(cmdline.decode("utf-8", "replace"))
        return ids

    def until_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.sample():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"jobs still queued after {timeout}s: {self.cluster.job_ids()}"
                )
            time.sleep(0.5)


def _files_containing(root: Path, needle: str) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                if needle.encode() in path.read_bytes():
                    found.append(path)
            except OSError:
                pass
    return found


def test_arena_grpo_mini_twin_trains_two_steps_on_slurm(
    slurm_cluster: SlurmCluster, tmp_path, tiny_model_dir, local_arena
):
    base_url, arena_token = local_arena
    admin_key = "sentinel-" + secrets.token_hex(12)
    creds = tmp_path / "credentials.env"
    creds.write_text(
        f"export ARENA_OPENAPI_BASE={base_url}\n"
        f"export ARENA_OPENAPI_TOKEN={arena_token}\n"
        f"export ARENA_LLM_API_KEY={arena_token}\n"
        f"export SWE_RL_ADMIN_API_KEY={admin_key}\n"
    )
    creds.chmod(stat.S_IRUSR | stat.S_IWUSR)
    image = tmp_path / "areal.sif"
    image.write_text("stand-in image\n")
    fileroot = tmp_path / "fileroot"
    fileroot.mkdir()
    env = {
        **{
            k: v for k, v in os.environ.items() if not k.startswith(("ARENA_", "SWE_RL_", "AREAL_"))
        },
        **slurm_cluster.env,
        "AREAL_DIR": str(REPO),
        "CONFIG_PATH": str(MINI_PROFILE),
        "ARENA_STREAM_ID": "arith-length",  # length-scored: rewards differ within a group
        "AREAL_IMAGE": str(image),
        "AREAL_PYTHON": sys.executable,
        "MODEL_PATH": str(tiny_model_dir),
        "AREAL_FILEROOT": str(fileroot),
        "ARENA_CREDENTIALS_FILE": str(creds),
        "AREAL_CONTROLLER_MOUNTS": f"{tmp_path}:{tmp_path}",
        "AREAL_WORKER_MOUNTS": f"{tmp_path}:{tmp_path}",
        "AREAL_CONTAINER_BIN": str(STANDIN),
        "CONTAINER_STANDIN_LOG": str(tmp_path / "standin.jsonl"),
        "ARENA_PREFLIGHT_MIN_TASKS": "0",  # a fresh local Arena has no finished tasks yet
        "HF_HUB_OFFLINE": "1",
    }
    watch = Watch(slurm_cluster)

    # 1. --check-arena: the controller job validates and runs preflight, nothing more
    env["TRIAL_NAME"] = "check"
    done = subprocess.run(
        ["bash", str(SCRIPT), "--check-arena"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    check_job = done.stdout.strip().splitlines()[-1].split(";")[0]
    assert check_job.isdigit(), done.stdout
    watch.until_idle(timeout=180)
    submission = fileroot / "submissions" / "check"
    log = (submission / f"controller-{check_job}.log").read_text()
    report = json.loads((submission / "preflight.json").read_text())
    assert report, log
    assert all(r.get("ok", True) for r in (report if isinstance(report, list) else [report])), (
        report
    )
    assert set(watch.jobs) == {check_job}, watch.jobs  # no worker job was submitted

    # 2. the full run: the controller submits worker jobs and trains two steps
    env["TRIAL_NAME"] = "train"
    done = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    train_job = done.stdout.strip().splitlines()[-1].split(";")[0]
    watch.until_idle(timeout=600)
    controller_log = (
        fileroot / "submissions" / "train" / f"controller-{train_job}.log"
    ).read_text()
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
    for secret in (admin_key, arena_token):
        assert not [j for j, text in watch.jobs.items() if secret in text]
        assert not [a for a in watch.argv if secret in a]
        assert _files_containing(fileroot, secret) == []
        assert _files_containing(slurm_cluster.root, secret) == []
