"""submit_arena.sh with stub sbatch, container and python executables (cases 25-39).

The stubs are small Python scripts placed on PATH (``sbatch``) or at ``AREAL_PYTHON``
(``python``); each appends its argv, environment and working directory to one JSON-lines
log. The container runtime is ``tests/fakes/container_standin.py``. Tests that exercise the
real Python step let the python stub hand over to this interpreter, with Arena played by a
scripted HTTP peer on loopback; nothing needs Slurm.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT, SECRET_SENTINEL, SWE_DIR
from tests.fakes.live_server import ScriptedASGI, serve
from tests.fakes.scripted_http import ScriptedHTTP, reply

SCRIPT = SWE_DIR / "submit_arena.sh"
CHECKOUT_SCRIPT = f"{REPO_ROOT}/examples/swe/submit_arena.sh"
STANDIN = REPO_ROOT / "tests" / "fakes" / "container_standin.py"
MULTI = "examples/swe/arena_multi_stream.yaml"
JOB_ID = "4242"
TRIAL = "trial-1"
CONTROLLER_MOUNTS = "/shared:/shared,/etc/slurm:/etc/slurm"
WORKER_MOUNTS = "/shared:/shared,/scratch:/scratch"
SECRETS = {
    "ARENA_OPENAPI_TOKEN": f"tok-{SECRET_SENTINEL}",
    "ARENA_LLM_API_KEY": f"llm-{SECRET_SENTINEL}",
    "SWE_RL_ADMIN_API_KEY": f"admin-{SECRET_SENTINEL}",
}
PROXIES = ("ALL_PROXY", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
UNUSED_ARENA = "http://127.0.0.1:9"  # discard port: any request to it fails fast
TRAINER = ["-m", "examples.swe.train_swe_rl", "--config"]

# Body of every stub; OPTIONS (baked in above it) selects what the stub does after logging.
STUB_BODY = '''
import json
import os
import sys


def run_batch_job(argv):
    """Run the job like slurmd: a spooled copy of the script, in --chdir, into --output."""
    import shutil
    import subprocess

    flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    first = next(i for i, a in enumerate(argv) if not a.startswith("-"))
    os.makedirs(OPTIONS["spool"], exist_ok=True)
    spooled = os.path.join(OPTIONS["spool"], "slurm_script")
    shutil.copy(argv[first], spooled)
    env = dict(os.environ, SLURM_JOB_ID=OPTIONS["job_id"])
    with open(flags["output"].replace("%j", OPTIONS["job_id"]), "w") as log:
        done = subprocess.run(
            [spooled, *argv[first + 1 :]],
            cwd=flags["chdir"], env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    with open(os.path.join(OPTIONS["spool"], "exit_code"), "w") as f:
        f.write(str(done.returncode))


argv = sys.argv[1:]
record = {"prog": OPTIONS["prog"], "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
with open(OPTIONS["log"], "a") as f:
    f.write(json.dumps(record) + "\\n")
if argv[:1] == ["-"] and OPTIONS.get("passthrough"):
    os.execv(OPTIONS["passthrough"], [OPTIONS["passthrough"], *argv])
if OPTIONS.get("run_batch_job"):
    run_batch_job(argv)
sys.stdout.write(OPTIONS.get("stdout", ""))
trainer = argv[:2] == ["-m", "examples.swe.train_swe_rl"]
sys.exit(OPTIONS.get("trainer_rc", 0) if trainer else OPTIONS.get("rc", 0))
'''


def write_stub(path: Path, prog: str, log: Path, **options: Any) -> Path:
    """An executable stub that logs each call to ``log`` as one JSON line, then acts.

    options: ``stdout`` (printed), ``rc`` (exit status), ``trainer_rc`` (exit status for
    ``-m examples.swe.train_swe_rl``), ``passthrough`` (interpreter that takes over a
    ``-`` call with the same argv and stdin), ``run_batch_job`` with ``spool`` and
    ``job_id`` (sbatch only: run the batch script synchronously, as slurmd would).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    options = {"prog": prog, "log": str(log), **options}
    # -S: the stubs need only the standard library, and skipping site halves start-up.
    path.write_text(f"#!{sys.executable} -S\nOPTIONS = {options!r}\n{STUB_BODY}")
    path.chmod(0o755)
    return path


def read_calls(log: Path, prog: str | None = None) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return [c for c in calls if prog is None or c["prog"] == prog]


class Site:
    """A fake cluster site: stub executables, shared paths and a credentials file."""

    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "bin"
        self.venv_bin = root / "venv" / "bin"
        self.python = self.venv_bin / "python"
        self.image = root / "images" / "areal.sif"
        self.model = root / "models" / "qwen3-4b"
        self.fileroot = root / "fileroot"
        self.credentials = root / "private" / "arena.env"
        self.log = root / "calls.jsonl"
        self.container_log = root / "container.jsonl"
        self.spool = root / "spool"
        for directory in (self.bin, self.model, self.image.parent, self.credentials.parent):
            directory.mkdir(parents=True, exist_ok=True)
        self.image.write_bytes(b"SIF")
        self.stub("sbatch", stdout=f"{JOB_ID}\n")
        self.stub("python")
        self.write_credentials()

    @property
    def submission_dir(self) -> Path:
        return self.fileroot / "submissions" / TRIAL

    def stub(self, prog: str, **options: Any) -> Path:
        directory = self.venv_bin if prog == "python" else self.bin
        return write_stub(directory / prog, prog, self.log, **options)

    def write_credentials(self, *, omit: tuple[str, ...] = (), **extra: str) -> None:
        values = {"ARENA_OPENAPI_BASE": UNUSED_ARENA, **SECRETS, **extra}
        lines = [f"export {k}={v}" for k, v in values.items() if k not in omit]
        self.credentials.write_text("\n".join(lines) + "\n")

    def env(self) -> dict[str, str]:
        return {
            "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(self.root),
            "LANG": "C.UTF-8",
            "AREAL_DIR": str(REPO_ROOT),
            "CONFIG_PATH": MULTI,
            "AREAL_IMAGE": str(self.image),
            "AREAL_PYTHON": str(self.python),
            "MODEL_PATH": str(self.model),
            "AREAL_FILEROOT": str(self.fileroot),
            "ARENA_CREDENTIALS_FILE": str(self.credentials),
            "AREAL_CONTROLLER_MOUNTS": CONTROLLER_MOUNTS,
            "AREAL_WORKER_MOUNTS": WORKER_MOUNTS,
            "TRIAL_NAME": TRIAL,
            "AREAL_CONTAINER_BIN": str(STANDIN),
            "CONTAINER_STANDIN_LOG": str(self.container_log),
            "CONTAINER_STANDIN_RECORD_ENV": "1",
            "ARENA_PREFLIGHT_HTTP_TIMEOUT": "30",
        }

    def run(
        self, *args: str, script: Path | str = SCRIPT, **changes: str | None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``script`` from an unrelated directory; a change of ``None`` unsets the var."""
        env = self.env()
        for name, value in changes.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        command = [str(script), *args]
        return subprocess.run(command, cwd=self.root, env=env, capture_output=True, text=True)

    def calls(self, prog: str) -> list[dict[str, Any]]:
        return read_calls(self.log, prog)

    def container_calls(self) -> list[dict[str, Any]]:
        if not self.container_log.exists():
            return []
        return [json.loads(line) for line in self.container_log.read_text().splitlines()]


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path)


def sbatch_argv(site: Site, *, trial: str = TRIAL, time: str = "01:30:00") -> list[str]:
    """The controller job's sbatch submission, flag by flag."""
    return [
        "--parsable",
        "--nodes=1",
        "--ntasks=1",
        "--cpus-per-task=4",
        "--mem=16G",
        "--gres=gpu:0",
        f"--time={time}",
        "--export=ALL",
        f"--job-name={trial}-controller",
        f"--chdir={REPO_ROOT}",
        f"--output={site.fileroot}/submissions/{trial}/controller-%j.log",
        CHECKOUT_SCRIPT,
        "--controller",
    ]


def scripted_arena(*, tasks: int = 1) -> ScriptedHTTP:
    """Arena serving the two placeholder Streams of arena_multi_stream.yaml."""
    api = "/openapi/v1"
    http = ScriptedHTTP()
    ref = {"key": "your-reward", "version": "1.0.0"}
    for sid in ("your-first-stream", "your-second-stream"):
        stream = {"stream_id": sid, "status": "ACTIVE", "default_reward_ref": ref}
        http.on("GET", f"{api}/streams/{sid}", reply(200, {"data": {"stream": stream}}))
        http.on("POST", f"{api}/streams/{sid}/dataset", reply(200, {"data": {"total": 12}}))
        task = {
            "status": "DONE",
            "harness_ref": {"key": "your-harness", "version": "version"},
            "reward_ref": ref,
        }
        rows = [task] * tasks
        http.on("GET", f"{api}/streams/{sid}/tasks", reply(200, {"data": {"items": rows}}))
    http.on(
        "GET",
        f"{api}/harnesses/your-harness/versions/version",
        reply(200, {"data": {"status": "PUBLISHED"}}),
    )
    return http


def files_text(*roots: Path) -> str:
    """Every file under ``roots``, concatenated (to look for a planted secret)."""
    return "\n".join(
        path.read_text(errors="replace")
        for root in roots
        for path in sorted(root.rglob("*"))
        if path.is_file()
    )


# --- case 25: arguments ---


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["--help", "--run", "extra"]])
def test_help_prints_usage(site, args):
    done = site.run(*args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: submit_arena.sh [--check-arena")
    for required in ("AREAL_IMAGE", "AREAL_PYTHON", "MODEL_PATH", "AREAL_FILEROOT"):
        assert required in done.stdout
    for text in ("ARENA_CREDENTIALS_FILE", "AREAL_CONTROLLER_MOUNTS", "AREAL_WORKER_MOUNTS"):
        assert text in done.stdout
    assert "ARENA_CONTROLLER_TIME     01:30:00" in done.stdout
    assert "SBATCH_TIMELIMIT          01:00:00" in done.stdout
    assert "arena_multi_stream.yaml" in done.stdout and "GPU topology" in done.stdout
    assert "no GPU workers" in done.stdout
    assert "never pass a token or key as a\ncommand argument" in done.stdout
    assert site.calls("sbatch") == []


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--bogus"], "Unknown argument"),
        ([""], "Unknown argument"),
        (["--check-arena", "--run"], "at most one argument"),
        (["--run", "extra"], "at most one argument"),
    ],
)
def test_bad_arguments_exit_2(site, args, phrase):
    done = site.run(*args)
    assert done.returncode == 2
    assert phrase in done.stderr
    assert site.calls("sbatch") == [] and site.container_calls() == []


# --- case 26: required variables ---

# In the order the script checks them.
REQUIRED = [
    "AREAL_DIR",
    "CONFIG_PATH",
    "AREAL_IMAGE",
    "AREAL_PYTHON",
    "MODEL_PATH",
    "AREAL_FILEROOT",
    "ARENA_CREDENTIALS_FILE",
    "AREAL_CONTROLLER_MOUNTS",
    "AREAL_WORKER_MOUNTS",
]


@pytest.mark.parametrize("missing", REQUIRED)
@pytest.mark.parametrize("value", [None, ""])
def test_controller_requires_each_variable(site, missing, value):
    # In --controller mode nothing has a default, so all nine are checked.
    done = site.run("--controller", **{missing: value})
    assert done.returncode == 1
    assert missing in done.stderr
    assert site.container_calls() == []


@pytest.mark.parametrize("missing", REQUIRED[2:])  # AREAL_DIR and CONFIG_PATH have defaults
def test_submit_requires_each_variable(site, missing):
    done = site.run(**{missing: None})
    assert done.returncode == 1
    assert missing in done.stderr
    assert site.calls("sbatch") == []


def test_required_variables_are_checked_in_order(site):
    done = site.run("--controller", AREAL_IMAGE=None, AREAL_WORKER_MOUNTS=None)
    assert done.returncode == 1
    assert "AREAL_IMAGE" in done.stderr and "AREAL_WORKER_MOUNTS" not in done.stderr


# --- cases 27-28: path checks ---


@pytest.mark.parametrize(
    "name", ["AREAL_DIR", "AREAL_IMAGE", "MODEL_PATH", "AREAL_FILEROOT", "ARENA_CREDENTIALS_FILE"]
)
def test_relative_shared_paths_exit_2(site, name):
    done = site.run(**{name: "relative/path"})
    assert done.returncode == 2
    assert f"{name} must be an absolute shared path" in done.stderr
    assert site.calls("sbatch") == []


def test_relative_config_path_resolves_against_areal_dir(site):
    assert not (site.root / MULTI).exists()  # the script runs from site.root
    done = site.run()
    assert done.returncode == 0, done.stderr
    assert site.calls("sbatch")[0]["env"]["CONFIG_PATH"] == MULTI


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CONFIG_PATH", "examples/swe/missing.yaml"),
        ("AREAL_IMAGE", "/nonexistent/areal.sif"),
        ("ARENA_CREDENTIALS_FILE", "/nonexistent/arena.env"),
        ("MODEL_PATH", "/nonexistent/model"),
    ],
)
def test_unreadable_inputs_exit_2(site, name, value):
    done = site.run(**{name: value})
    assert done.returncode == 2
    assert "missing/unreadable" in done.stderr and name in done.stderr
    assert site.calls("sbatch") == []


def test_model_path_must_be_a_directory_and_failures_are_combined(site):
    done = site.run(MODEL_PATH=str(site.image), AREAL_IMAGE=str(site.model))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1  # one combined message
    assert "MODEL_PATH" in done.stderr and "AREAL_IMAGE" in done.stderr


# --- cases 29-31: submit mode ---


@pytest.mark.parametrize("argument", ["", "--check-arena"])
def test_submit_execs_sbatch_with_the_controller_job(site, argument):
    args = [argument] if argument else []
    done = site.run(*args, SLURM_JOB_ID="777", SBATCH_PARTITION="cpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{JOB_ID}\n"  # sbatch's parsable output is passed through
    [call] = site.calls("sbatch")
    assert call["argv"] == sbatch_argv(site)  # a separate job, even inside an allocation
    env = call["env"]
    assert env["ARENA_CHECK_ONLY"] == argument
    assert env["ARENA_SUBMISSION_DIR"] == str(site.submission_dir)
    assert env["SLURM_EXPORT_ENV"] == "ALL"
    assert env["SBATCH_TIMELIMIT"] == "01:00:00"
    assert env["SBATCH_PARTITION"] == "cpu"
    assert env["TRIAL_NAME"] == TRIAL
    assert site.submission_dir.is_dir()
    assert site.container_calls() == [] and site.calls("python") == []


def test_submit_time_limits(site):
    done = site.run(ARENA_CONTROLLER_TIME="03:00:00", SBATCH_TIMELIMIT="02:00:00")
    assert done.returncode == 0, done.stderr
    [call] = site.calls("sbatch")
    assert call["argv"] == sbatch_argv(site, time="03:00:00")
    assert call["env"]["SBATCH_TIMELIMIT"] == "02:00:00"  # workers inherit it


def test_submit_status_is_sbatchs(site):
    site.stub("sbatch", rc=1)
    assert site.run().returncode == 1


def test_submit_drops_tokens_from_the_callers_environment(site):
    done = site.run(**SECRETS)
    assert done.returncode == 0, done.stderr
    [call] = site.calls("sbatch")
    assert SECRET_SENTINEL not in json.dumps(call)


def test_generated_trial_name(site):
    done = site.run(TRIAL_NAME=None)
    assert done.returncode == 0, done.stderr
    [call] = site.calls("sbatch")
    trial = call["env"]["TRIAL_NAME"]
    assert re.fullmatch(r"arena-\d{8}-\d{6}-\d+", trial)
    assert call["argv"] == sbatch_argv(site, trial=trial)
    assert (site.fileroot / "submissions" / trial).is_dir()


def test_areal_dir_defaults_to_the_physical_checkout(site):
    link = site.root / "checkout-link"
    link.symlink_to(REPO_ROOT)
    done = site.run(
        script=link / "examples" / "swe" / "submit_arena.sh", AREAL_DIR=None, CONFIG_PATH=None
    )
    assert done.returncode == 0, done.stderr
    [call] = site.calls("sbatch")
    assert call["argv"] == sbatch_argv(site)  # --chdir and the script path are physical
    assert call["env"]["AREAL_DIR"] == str(REPO_ROOT)
    assert call["env"]["CONFIG_PATH"] == "examples/swe/arena_grpo.yaml"


# --- case 32: controller mode from the spooled copy ---


def spooled_copy(site: Site) -> Path:
    site.spool.mkdir(exist_ok=True)
    return Path(shutil.copy(SCRIPT, site.spool / "slurm_script"))


def test_controller_execs_the_container_with_the_checkout_script(site):
    done = site.run("--controller", script=spooled_copy(site), ARENA_CHECK_ONLY="--check-arena")
    assert done.returncode == 0, done.stderr
    [call] = site.container_calls()
    exec_flags = ["exec", "--no-eval", "--pid", "--writable-tmpfs"]
    image_and_command = [str(site.image), "bash", CHECKOUT_SCRIPT, "--run"]
    assert call["argv"] == [*exec_flags, "--bind", CONTROLLER_MOUNTS, *image_and_command]
    assert call["binds"] == ["/shared:/shared", "/etc/slurm:/etc/slurm"]
    # The stand-in ran the command: run mode reached the (stubbed) Python step.
    [step] = site.calls("python")
    assert step["argv"] == ["-", MULTI]


def test_controller_default_runtime_is_apptainer(site):
    site.stub("apptainer")
    done = site.run("--controller", script=spooled_copy(site), AREAL_CONTAINER_BIN=None)
    assert done.returncode == 0, done.stderr
    [call] = site.calls("apptainer")
    assert call["argv"][:4] == ["exec", "--no-eval", "--pid", "--writable-tmpfs"]
    assert call["argv"][-2:] == [CHECKOUT_SCRIPT, "--run"]


def test_controller_reports_a_missing_runtime(site):
    done = site.run("--controller", AREAL_CONTAINER_BIN="/nonexistent/apptainer")
    assert done.returncode == 1
    assert "AREAL_CONTAINER_BIN" in done.stderr


# --- cases 33-35: run mode environment ---


@pytest.mark.parametrize(
    ("launch_stream", "seen_stream"),
    [("selected-stream", "selected-stream"), ("", ""), (None, "obsolete-stream")],
)
def test_run_launch_values_win_over_the_credentials_file(site, launch_stream, seen_stream):
    site.write_credentials(
        MODEL_PATH="/obsolete/model",
        ARENA_STREAM_ID="obsolete-stream",
        DATASET_CONFIG="/from/credentials.yaml",
    )
    done = site.run("--run", ARENA_CHECK_ONLY="", ARENA_STREAM_ID=launch_stream)
    assert done.returncode == 0, done.stderr
    step, trainer = site.calls("python")
    env = step["env"]
    assert env["MODEL_PATH"] == str(site.model)
    assert env["ARENA_STREAM_ID"] == seen_stream  # a launch value, even empty, wins
    assert env["DATASET_CONFIG"] == "/from/credentials.yaml"  # not a launch variable
    assert env["APPTAINER_BIND"] == env["SINGULARITY_BIND"] == WORKER_MOUNTS
    assert trainer["env"]["MODEL_PATH"] == str(site.model)


def test_run_environment_and_argv(site):
    proxies = dict.fromkeys(PROXIES, "http://proxy.invalid:3128")
    done = site.run("--run", ARENA_CHECK_ONLY="", PYTHONPATH="/old/pythonpath", **proxies)
    assert done.returncode == 0, done.stderr
    step, trainer = site.calls("python")
    assert step["argv"] == ["-", MULTI]
    assert trainer["argv"] == [*TRAINER, MULTI]
    for call in (step, trainer):
        env = call["env"]
        assert not set(PROXIES) & set(env)
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["PYTHONPATH"] == f"{REPO_ROOT}:/old/pythonpath"
        assert env["PATH"].split(os.pathsep)[0] == str(site.venv_bin)
        assert env["SLURM_EXPORT_ENV"] == "ALL"
        assert env["ARENA_SUBMISSION_DIR"] == str(site.submission_dir)
        assert call["cwd"] == str(REPO_ROOT)
        assert {k: env[k] for k in SECRETS} == SECRETS  # sourced from the file


def test_run_pythonpath_without_an_old_value(site):
    done = site.run("--run", ARENA_CHECK_ONLY="--check-arena", PYTHONPATH="")
    assert done.returncode == 0, done.stderr
    [step] = site.calls("python")  # check-only: no trainer
    assert step["env"]["PYTHONPATH"] == str(REPO_ROOT)


def test_run_exit_status_is_the_steps_or_the_trainers(site):
    site.stub("python", rc=5)
    done = site.run("--run", ARENA_CHECK_ONLY="")
    assert done.returncode == 5
    assert len(site.calls("python")) == 1  # no trainer after a failed step
    site.stub("python", trainer_rc=3)
    assert site.run("--run", ARENA_CHECK_ONLY="").returncode == 3


@pytest.mark.parametrize(
    "missing",
    ["ARENA_OPENAPI_BASE", "ARENA_OPENAPI_TOKEN", "ARENA_LLM_API_KEY", "SWE_RL_ADMIN_API_KEY"],
)
def test_run_requires_each_credential(site, missing):
    site.write_credentials(omit=(missing,))
    done = site.run("--run", ARENA_CHECK_ONLY="")
    assert done.returncode == 1
    assert missing in done.stderr
    assert SECRET_SENTINEL not in done.stdout + done.stderr
    assert site.calls("python") == []


@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_run_takes_secrets_only_from_the_credentials_file(site, secret):
    site.write_credentials(omit=(secret,))
    done = site.run("--run", ARENA_CHECK_ONLY="", **{secret: "from-the-environment"})
    assert done.returncode == 1
    assert secret in done.stderr
    assert site.calls("python") == []


def test_a_malformed_credentials_file_prints_no_value(site):
    site.credentials.write_text(f"export ARENA_OPENAPI_BASE={UNUSED_ARENA}\n{SECRET_SENTINEL}\n")
    done = site.run("--run", ARENA_CHECK_ONLY="")
    assert done.returncode != 0
    assert "sourcing ARENA_CREDENTIALS_FILE failed" in done.stderr
    assert SECRET_SENTINEL not in done.stdout + done.stderr
    assert site.calls("python") == []


def test_xtrace_from_the_caller_is_switched_off(site):
    done = site.run("-x", str(SCRIPT), "--run", script="bash", ARENA_CHECK_ONLY="")
    assert done.returncode == 0, done.stderr
    assert SECRET_SENTINEL not in done.stdout + done.stderr
    assert len(site.calls("python")) == 2


# --- cases 36-37: the whole chain, with the real Python step ---


@pytest.mark.parametrize("argument", ["", "--check-arena"])
def test_full_chain_keeps_secrets_out(site, argument):
    site.stub(
        "sbatch",
        stdout=f"{JOB_ID}\n",
        run_batch_job=True,
        spool=str(site.spool),
        job_id=JOB_ID,
    )
    site.stub("python", passthrough=sys.executable)
    http = scripted_arena()
    proxies = dict.fromkeys(PROXIES, UNUSED_ARENA)
    with serve(ScriptedASGI(http)) as url:
        site.write_credentials(ARENA_OPENAPI_BASE=url)
        done = site.run(*([argument] if argument else []), **proxies)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{JOB_ID}\n"
    assert (site.spool / "exit_code").read_text() == "0"
    log = (site.submission_dir / f"controller-{JOB_ID}.log").read_text()
    assert "Arena preflight passed for 2 Stream(s) (first, second)" in log

    report_text = (site.submission_dir / "preflight.json").read_text(encoding="utf-8")
    report = json.loads(report_text)
    assert report_text == json.dumps(report, indent=2) + "\n"
    assert [s["name"] for s in report["streams"]] == ["first", "second"]
    assert http.requests and all(
        r.headers["authorization"] == f"Bearer {SECRETS['ARENA_OPENAPI_TOKEN']}"
        for r in http.requests
    )

    [submit] = site.calls("sbatch")
    [container] = site.container_calls()
    assert container["command"] == ["bash", CHECKOUT_SCRIPT, "--run"]
    python_calls = site.calls("python")
    assert python_calls[0]["argv"] == ["-", MULTI]
    if argument:
        assert len(python_calls) == 1  # check-only: no trainer
    else:
        assert python_calls[1]["argv"] == [*TRAINER, MULTI]

    # The sentinel is in no output, argv, log, report or saved config, and no child
    # environment holds it except under the credential names in run mode.
    assert SECRET_SENTINEL not in done.stdout + done.stderr
    assert SECRET_SENTINEL not in json.dumps(submit) + json.dumps(container)
    assert SECRET_SENTINEL not in files_text(site.fileroot, site.spool)
    for call in python_calls:
        assert SECRET_SENTINEL not in json.dumps(call["argv"])
        holders = {k for k, v in call["env"].items() if SECRET_SENTINEL in v}
        assert holders == set(SECRETS)
        assert not set(PROXIES) & set(call["env"])
    saved = list(site.fileroot.glob(f"logs/*/arena-grpo/{TRIAL}/config.yaml"))
    assert len(saved) == 1 and "<redacted>" in saved[0].read_text()


@pytest.fixture
def configs(tmp_path: Path) -> Path:
    """arena_grpo.yaml next to two children that break the entrypoint's requirements."""
    directory = tmp_path / "configs"
    directory.mkdir()
    shutil.copy(SWE_DIR / "arena_grpo.yaml", directory)
    head = "defaults:\n  - arena_grpo\n  - _self_\n"
    (directory / "local.yaml").write_text(
        head + "scheduler:\n  type: local\neconfig:\n  stream_id: stream-a\n"
    )
    (directory / "jsonl.yaml").write_text(
        head + "econfig:\n  dataset_source: jsonl\n  dataset_path: /data/train.jsonl\n"
    )
    return directory


@pytest.mark.parametrize(
    ("config", "phrases"),
    [
        ("local.yaml", ("ValueError", "scheduler.type 'local'")),
        # refused by the config loader itself, naming the field
        ("jsonl.yaml", ("jsonl.yaml: econfig.dataset_source: 'jsonl' is not supported",)),
    ],
)
def test_run_rejects_configs_outside_slurm_and_arena(site, configs, config, phrases):
    site.stub("python", passthrough=sys.executable)
    done = site.run("--run", ARENA_CHECK_ONLY="", CONFIG_PATH=str(configs / config))
    assert done.returncode == 1
    assert all(phrase in done.stderr for phrase in phrases)
    assert not (site.submission_dir / "preflight.json").exists()
    assert len(site.calls("python")) == 1  # no trainer


@pytest.mark.parametrize(
    ("min_tasks", "passes"), [(None, False), ("0", True)], ids=["default-min", "min-0"]
)
def test_run_preflight_gate(site, min_tasks, passes):
    # Zero recent tasks fail the default health rule (1 terminal task); min 0 accepts them.
    site.stub("python", passthrough=sys.executable)
    http = scripted_arena(tasks=0)
    with serve(ScriptedASGI(http)) as url:
        site.write_credentials(ARENA_OPENAPI_BASE=url)
        done = site.run("--run", ARENA_CHECK_ONLY="", ARENA_PREFLIGHT_MIN_TASKS=min_tasks)
    report = site.submission_dir / "preflight.json"
    python_calls = site.calls("python")
    if passes:
        assert done.returncode == 0, done.stderr
        streams = json.loads(report.read_text())["streams"]
        assert [s["recent_terminal_tasks"] for s in streams] == [0, 0]
        assert python_calls[-1]["argv"] == [*TRAINER, MULTI]
    else:
        assert done.returncode == 1
        assert not report.exists()
        assert len(python_calls) == 1  # no trainer
    assert SECRET_SENTINEL not in done.stdout + done.stderr


@pytest.mark.parametrize("value", ["", "two"])
def test_run_rejects_a_bad_min_tasks_value(site, value):
    site.stub("python", passthrough=sys.executable)
    done = site.run("--run", ARENA_CHECK_ONLY="", ARENA_PREFLIGHT_MIN_TASKS=value)
    assert done.returncode == 1
    assert "ARENA_PREFLIGHT_MIN_TASKS must be an integer" in done.stderr
    assert not (site.submission_dir / "preflight.json").exists()


# --- case 39: the single-Stream profile needs an explicit Stream id ---


def test_single_stream_profile_without_stream_id_fails_in_preflight_loading(site):
    site.stub("python", passthrough=sys.executable)
    done = site.run(
        "--run",
        ARENA_CHECK_ONLY="",
        CONFIG_PATH="examples/swe/arena_grpo.yaml",
        ARENA_STREAM_ID=None,
    )
    assert done.returncode == 1
    assert "non-empty stream_id" in done.stderr
    assert not (site.submission_dir / "preflight.json").exists()


# --- the container stand-in itself ---


def test_container_standin_applies_apptainers_environment_rules(tmp_path):
    image = tmp_path / "image.sif"
    image.write_bytes(b"SIF")
    log = tmp_path / "standin.jsonl"
    env = {
        "PATH": os.environ["PATH"],
        "APPTAINERENV_FROM_PREFIX": "p",
        "CONTAINER_STANDIN_LOG": str(log),
        "APPTAINER_BIND": "/a:/a",
    }
    show = 'echo "$FROM_PREFIX|$A|$B|$C|$PWD|${APPTAINERENV_FROM_PREFIX-gone}"; exit 7'
    argv = ["exec", "--nv", "-B", "/x:/x,/y:/y", "--env", "A=1,B=2", "--env", '"C=3,4"']
    argv += ["--pwd", str(tmp_path), str(image), "bash", "-c", show]
    done = subprocess.run([str(STANDIN), *argv], env=env, capture_output=True, text=True)
    assert done.returncode == 7  # the command's status
    assert done.stdout == f"p|1|2|3,4|{tmp_path}|gone\n"
    [entry] = [json.loads(line) for line in log.read_text().splitlines()]
    assert entry["argv"] == argv
    assert entry["binds"] == ["/x:/x", "/y:/y"]
    assert entry["env_binds"] == {"APPTAINER_BIND": "/a:/a"}
    assert entry["image"] == str(image)
    assert entry["command"] == ["bash", "-c", show]
    assert "env" not in entry  # recording the environment is opt-in


@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (["exec", "/nonexistent/image.sif", "true"], 255),
        (["run", str(STANDIN), "true"], 255),
        (["exec", str(STANDIN)], 255),
        (["exec", str(STANDIN), "no-such-command-here"], 127),
    ],
)
def test_container_standin_failures(argv, status):
    done = subprocess.run([str(STANDIN), *argv], capture_output=True, text=True)
    assert done.returncode == status
    assert "FATAL" in done.stderr
