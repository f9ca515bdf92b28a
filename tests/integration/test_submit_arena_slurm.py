"""``submit_arena.sh`` on a real single-node Slurm cluster against a local Arena.

The container binary is the stand-in (``tests/fakes/container_standin.py``): it records
argv and binds and runs the command on the host. A CPU profile (the ``hf`` inference
backend, FSDP on CPU, a tiny model) lets the controller job submit its worker jobs through
``SlurmScheduler`` and train one step on this machine.
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
import yaml

from tests.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "swe" / "submit_arena.sh"
STANDIN = REPO / "tests" / "fakes" / "container_standin.py"
LOCAL_PROFILE = REPO / "examples" / "swe" / "arena_local.yaml"


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


def _cpu_profile(path: Path) -> Path:
    """``arena_local.yaml`` moved onto Slurm: workers are jobs in the (stand-in) image."""
    profile = yaml.safe_load(LOCAL_PROFILE.read_text())
    profile["experiment_name"] = "arena-slurm"
    profile["total_train_steps"] = 1
    profile["cluster"]["fileroot"] = "${oc.env:AREAL_FILEROOT}"
    profile["scheduler"] = {"type": "slurm"}
    profile["train_dataset"]["batch_size"] = 2
    profile["gconfig"]["n_samples"] = 2
    profile["rollout"]["max_head_offpolicyness"] = 0
    worker = {
        "task_type": "worker",
        "gpu": 0,
        "cpu": 1,
        "mem": 2,
        "image": "${oc.env:AREAL_IMAGE}",
        "cmd": "${oc.env:AREAL_PYTHON} -m areal.infra.rpc.rpc_server",
        "env_vars": {"PYTHONPATH": "${oc.env:AREAL_DIR}", "HF_HUB_OFFLINE": "1"},
        "additional_bash_cmds": ['set -a; source "$ARENA_CREDENTIALS_FILE"; set +a'],
    }
    profile["actor"]["scheduling_spec"] = [{**worker, "port_count": 2}]
    profile["rollout"]["scheduling_spec"] = [{**worker, "port_count": 1}]
    econfig = profile["econfig"]
    econfig["arena_base_url"] = "${oc.env:ARENA_OPENAPI_BASE}"
    econfig["arena_llm_route_mode"] = "gateway"
    econfig["arena_mixture_epoch_size"] = 2
    econfig["arena_result_dump_dir"] = "${cluster.fileroot}/arena_results/${trial_name}"
    econfig["arena_streams"] = [{"name": "arith", "stream_id": "arith-easy"}]
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    return path


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


def test_check_arena_then_one_training_step_on_slurm(
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
        "CONFIG_PATH": str(_cpu_profile(tmp_path / "arena_slurm_cpu.yaml")),
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

    # 2. the full run: the controller submits worker jobs and trains one step
    env["TRIAL_NAME"] = "train"
    done = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    train_job = done.stdout.strip().splitlines()[-1].split(";")[0]
    watch.until_idle(timeout=480)
    controller_log = (
        fileroot / "submissions" / "train" / f"controller-{train_job}.log"
    ).read_text()
    stats = (
        fileroot / "logs" / os.environ.get("USER", "root") / "arena-slurm" / "train" / "stats.jsonl"
    )
    if not stats.exists():
        stats = next(fileroot.rglob("arena-slurm/train/stats.jsonl"), stats)
    assert stats.exists(), controller_log[-4000:]
    rows = [json.loads(x) for x in stats.read_text().splitlines() if x.strip()]
    assert [r["global_step"] for r in rows] == [0], controller_log[-4000:]
    worker_jobs = set(watch.jobs) - {check_job, train_job}
    assert len(worker_jobs) >= 2, watch.jobs  # actor and rollout roles ran as their own jobs
    assert slurm_cluster.job_ids() == []

    # 3. secrets: in no job script, scontrol output, argv, log or report
    for secret in (admin_key, arena_token):
        assert not [j for j, text in watch.jobs.items() if secret in text]
        assert not [a for a in watch.argv if secret in a]
        assert _files_containing(fileroot, secret) == []
        assert _files_containing(slurm_cluster.root, secret) == []
