"""What the tests of the submit scripts on a real single-node Slurm cluster share: a local
Arena server process, a watch over the cluster's jobs and every process's argv, and a scan
of files for a secret."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "tests" / "fakes" / "container_standin.py"


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


def files_containing(root: Path, needle: str) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                if needle.encode() in path.read_bytes():
                    found.append(path)
            except OSError:
                pass
    return found


@dataclass
class Submission:
    """The environment a submit script runs with, where its runs write, and the secrets
    that must appear nowhere (job scripts, argv, logs, reports)."""

    env: dict[str, str]
    fileroot: Path
    secrets: tuple[str, ...]

    def submit(self, script: Path, *args: str, trial: str) -> str:
        """Run ``script args`` as a user on the login node would; returns the job id."""
        env = {**self.env, "TRIAL_NAME": trial}
        done = subprocess.run(
            ["bash", str(script), *args],
            cwd=self.fileroot.parent,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        job = done.stdout.strip().splitlines()[-1].split(";")[0]
        assert job.isdigit(), done.stdout
        return job

    def controller_log(self, trial: str, job: str) -> str:
        return (self.fileroot / "submissions" / trial / f"controller-{job}.log").read_text()


def submission(
    tmp_path: Path, cluster: SlurmCluster, arena: tuple[str, str], model: Path, config: Path
) -> Submission:
    """A private credentials file for ``arena`` (its URL and token) and a random proxy admin
    key, a stand-in image, the container stand-in and the shared paths, as submit_arena.sh
    reads them; no AREAL_/ARENA_/SWE_RL_ variable of the caller leaks in."""
    base_url, arena_token = arena
    admin_key = "sentinel-" + secrets.token_hex(12)
    credentials = tmp_path / "credentials.env"
    credentials.write_text(
        f"export ARENA_OPENAPI_BASE={base_url}\n"
        f"export ARENA_OPENAPI_TOKEN={arena_token}\n"
        f"export ARENA_LLM_API_KEY={arena_token}\n"
        f"export SWE_RL_ADMIN_API_KEY={admin_key}\n"
    )
    credentials.chmod(stat.S_IRUSR | stat.S_IWUSR)
    image = tmp_path / "areal.sif"
    image.write_text("stand-in image\n")
    fileroot = tmp_path / "fileroot"
    fileroot.mkdir()
    inherited = {
        k: v for k, v in os.environ.items() if not k.startswith(("ARENA_", "SWE_RL_", "AREAL_"))
    }
    env = {
        **inherited,
        **cluster.env,
        "AREAL_DIR": str(REPO),
        "CONFIG_PATH": str(config),
        "AREAL_IMAGE": str(image),
        "AREAL_PYTHON": sys.executable,
        "MODEL_PATH": str(model),
        "AREAL_FILEROOT": str(fileroot),
        "ARENA_CREDENTIALS_FILE": str(credentials),
        "AREAL_CONTROLLER_MOUNTS": f"{tmp_path}:{tmp_path}",
        "AREAL_WORKER_MOUNTS": f"{tmp_path}:{tmp_path}",
        "AREAL_CONTAINER_BIN": str(STANDIN),
        "CONTAINER_STANDIN_LOG": str(tmp_path / "standin.jsonl"),
        "ARENA_PREFLIGHT_MIN_TASKS": "0",  # a fresh local Arena has no finished tasks yet
        "HF_HUB_OFFLINE": "1",
    }
    return Submission(env, fileroot, (admin_key, arena_token))


def assert_no_secret_leaked(submission: Submission, watch: Watch, cluster: SlurmCluster) -> None:
    """No secret in any job script, scontrol output, argv, log or report."""
    for secret in submission.secrets:
        assert not [j for j, text in watch.jobs.items() if secret in text]
        assert not [a for a in watch.argv if secret in a]
        assert files_containing(submission.fileroot, secret) == []
        assert files_containing(cluster.root, secret) == []
