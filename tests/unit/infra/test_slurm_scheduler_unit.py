"""Slurm batch scripts without a cluster: resource math, quoting, the script run by bash.

Generated shell is checked by running it: words through ``bash``, the GPU selection
with a given ``$SLURM_LOCALID``, and a whole batch script with a fake ``srun`` and the
container stand-in (or with fake ``squeue``/``scancel`` for the controller watcher). The
scheduler's fail-fast path runs against fake Slurm clients, its check for jobs a dead
controller left against a fake queue in place of ``SlurmScheduler._slurm``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from areal.api.cli_args import (
    BaseExperimentConfig,
    ClusterSpecConfig,
    NameResolveConfig,
    PPOConfig,
    SchedulingSpec,
)
from areal.api.scheduler_api import RPC_TOKEN_ENV, Job
from areal.infra.scheduler.exceptions import (
    SchedulerError,
    WorkerConfigurationError,
    WorkerCreationError,
)
from areal.infra.scheduler.slurm import SlurmScheduler, capacity_problem
from areal.infra.scheduler.slurm_batch import (
    BatchJob,
    SlurmResources,
    batch_script,
    gpu_selection,
    plan_resources,
    sbatch_options,
    secrets_file_text,
    shell_word,
    split_env,
    worker_env,
)
from areal.utils import name_resolve
from areal.utils.secrets import SecretStr

REPO_ROOT = Path(__file__).resolve().parents[3]
STANDIN = REPO_ROOT / "tests" / "fakes" / "container_standin.py"


# --- resources ---


def test_cpu_role_runs_on_one_node_with_memory_per_task():
    r = plan_resources(SchedulingSpec(cpu=2, mem=3, gpu=0), 4, 8, "proxy")
    assert (r.nodes, r.ntasks, r.ntasks_per_node, r.cpus_per_task) == (1, 4, 4, 2)
    assert r.mem_per_task_mb == 3 * 1024  # 3072
    assert r.mem_per_node_mb == 4 * 3072  # 12288, sbatch --mem
    assert r.mem_per_cpu_mb == 3072 // 2  # 1536, srun --mem-per-cpu
    assert r.gres_gpus_per_node == 0


def test_gpu_roles_take_whole_nodes_or_one_partial_node():
    # 16 workers x 1 GPU on 8-GPU nodes: ceil(16 / 8) = 2 nodes of 8 workers
    r = plan_resources(SchedulingSpec(gpu=1, cpu=8, mem=32), 16, 8, "actor")
    assert (r.nodes, r.ntasks_per_node, r.gres_gpus_per_node, r.gpus_per_task) == (2, 8, 8, 1)
    # 2 workers x 2 GPUs: ceil(4 / 8) = 1 node with 2 x 2 = 4 GPUs
    r = plan_resources(SchedulingSpec(gpu=2), 2, 8, "rollout")
    assert (r.nodes, r.ntasks_per_node, r.gres_gpus_per_node) == (1, 2, 4)


def test_resource_requests_that_cannot_be_laid_out_are_refused():
    with pytest.raises(WorkerConfigurationError, match="cannot be spread evenly over 2 nodes"):
        plan_resources(SchedulingSpec(gpu=4), 3, 8, "actor")  # 12 GPUs -> 2 nodes, 3 workers
    with pytest.raises(WorkerConfigurationError, match="cannot span nodes"):
        plan_resources(SchedulingSpec(gpu=16), 1, 8, "actor")
    with pytest.raises(WorkerConfigurationError, match="n_gpus_per_node is 0"):
        plan_resources(SchedulingSpec(gpu=1), 1, 0, "actor")
    with pytest.raises(WorkerConfigurationError, match="2 nodes of the role"):
        plan_resources(SchedulingSpec(), 3, 8, "proxy", pinned_nodes=["n1", "n2"])


def test_a_role_pinned_to_another_roles_nodes_asks_for_no_gpus():
    r = plan_resources(SchedulingSpec(gpu=1, nodelist="x"), 4, 8, "ref", pinned_nodes=["n1", "n2"])
    assert (r.nodes, r.ntasks_per_node, r.nodelist) == (2, 2, "n1,n2")
    assert r.gres_gpus_per_node == 0 and r.gpus_per_task == 0


# --- quoting ---


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("plain", "plain"),
        ("two words", "two words"),
        ("it's", "it's"),
        ('say "hi"', 'say "hi"'),
        ("$FOO/x", "bar/x"),
        ("${FOO}y", "bary"),
        ("$FOOy", ""),  # another (unset) variable, as in the shell
        ("$(echo pwned)", "$(echo pwned)"),
        ("`echo pwned`", "`echo pwned`"),
        ("$$FOO", "$FOO"),
        ("cost $5 and $", "cost $5 and $"),
        ("${FOO", "${FOO"),
        ("back\\slash", "back\\slash"),
        ("*", "*"),
        ("a\nb", "a\nb"),
    ],
)
def test_shell_word_expands_only_variable_references(value, expected, tmp_path):
    result = subprocess.run(
        ["bash", "-c", f"printf %s {shell_word(value)}"],
        env={"PATH": os.environ["PATH"], "FOO": "bar"},
        cwd=tmp_path,  # a glob that expanded would list this (empty) directory
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout == expected


def test_shell_word_shapes():
    assert shell_word("a b") == "'a b'"
    assert shell_word("$HOME/x $(id)") == '"${HOME}/x \\$(id)"'


def test_env_values_are_routed_by_what_they_contain():
    env = {
        "A": "plain value",
        "B": "a,b",  # apptainer --env would split it
        "C": "$HOME/x",  # expands on the worker, never on a command line
        "D": SecretStr("s3cret"),
        "E": "x\ny",
    }
    flags, exports, secrets = split_env(env, "apptainer")
    assert flags == {"A": "plain value"}
    assert exports == {"B": "a,b", "C": "$HOME/x", "E": "x\ny"}
    assert secrets == {"D": "s3cret"} and type(secrets["D"]) is str
    flags, exports, secrets = split_env(env, "none")
    assert flags == {} and set(exports) == {"A", "B", "C", "E"} and set(secrets) == {"D"}


def test_worker_env_layers_base_threads_offload_and_user_values():
    spec = SchedulingSpec(cpu=4, env_vars={"PYTHONPATH": "/mine", "OMP_NUM_THREADS": "2"})
    env = worker_env(
        spec,
        cpus_per_task=4,
        python_path="/controller",
        enable_offload=True,
        controller_env={"AREAL_CACHE_DIR": "/cache", "MKL_NUM_THREADS": "7"},
        user="alice",
    )
    assert env["PYTHONPATH"] == "/mine"  # the user's value replaces the computed one
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["OPENBLAS_NUM_THREADS"] == "4"  # = cpus per task
    assert "MKL_NUM_THREADS" not in env  # the controller's own value is exported as is
    assert env["TRITON_CACHE_DIR"] == "/cache/triton"
    assert env["TOKENIZERS_PARALLELISM"] == "true" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env["TMS_INIT_ENABLE"] == "1"
    plain = worker_env(SchedulingSpec(), cpus_per_task=1, python_path="/c", controller_env={})
    assert plain["PYTHONPATH"] == "/c" and plain["VLLM_CACHE_ROOT"] == "/tmp/areal-areal/vllm"
    assert "TMS_INIT_ENABLE" not in plain
    with pytest.raises(WorkerConfigurationError, match="BAD-NAME"):
        worker_env(SchedulingSpec(env_vars={"BAD-NAME": "1"}), cpus_per_task=1, python_path="/c")


# --- GPU selection ---


@pytest.mark.parametrize(
    ("gpus", "local_id", "visible", "expected"),
    [
        (1, 0, None, "0"),
        (1, 3, None, "3"),
        (2, 1, None, "2,3"),  # worker 1 of 2-GPU workers: GPUs 2 and 3
        (2, 1, "4,5,6,7", "6,7"),  # a slice of the GPUs Slurm assigned
        (4, 0, "0,1,2,3,4,5,6,7", "0,1,2,3"),
    ],
)
def test_gpu_selection_gives_each_local_task_its_slice(gpus, local_id, visible, expected):
    script = (
        "\n".join(gpu_selection(gpus)) + '\necho "$CUDA_VISIBLE_DEVICES|$ASCEND_RT_VISIBLE_DEVICES"'
    )
    env = {"PATH": os.environ["PATH"], "SLURM_LOCALID": str(local_id)}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert result.stdout.strip() == f"{expected}|{expected}"


# --- the batch script ---


def make_job(tmp_path: Path, spec: SchedulingSpec, replicas: int = 1, n_gpus: int = 8) -> BatchJob:
    resources = plan_resources(spec, replicas, n_gpus, "actor")
    env = worker_env(spec, cpus_per_task=resources.cpus_per_task, python_path=str(REPO_ROOT))
    return BatchJob(
        role="actor",
        job_name="exp_trial:actor",
        resources=resources,
        spec=spec,
        env=env,
        worker_flags=["--experiment-name", "exp", "--trial-name", "trial", "--role", "actor"],
        container_bin=[sys.executable, str(STANDIN)],
        log_dir=tmp_path / "logs",
        secrets_file=tmp_path / "secrets" / "actor.env",
    )


def flat(script: str) -> str:
    """The script with its line continuations joined."""
    return script.replace(" \\\n    ", " ")


def test_gpu_job_script_options_and_container_flags(tmp_path):
    spec = SchedulingSpec(
        gpu=1,
        cpu=8,
        mem=32,
        image="/images/areal.sif",
        mount="/storage:/storage,/models:/models:ro",
        nodelist="gpu[1-2]",
        exclude="gpu3",
        reservation="rl",
        exclusive=True,
    )
    script = batch_script(make_job(tmp_path, spec, replicas=16))
    sbatch = [line.removeprefix("#SBATCH ") for line in script.splitlines() if "#SBATCH" in line]
    assert sbatch == [
        "--job-name=exp_trial:actor",
        f"--output={tmp_path}/logs/actor.log",
        "--open-mode=append",
        "--no-requeue",
        "--nodes=2",
        "--ntasks-per-node=8",
        "--cpus-per-task=8",
        f"--mem={8 * 32 * 1024}M",  # 8 tasks x 32 GB per node
        "--gres=gpu:8",
        '--nodelist="gpu[1-2]"',
        "--exclude=gpu3",
        "--reservation=rl",
        "--exclusive",
    ]
    assert "--mem-per-cpu=4096M --gres=gpu:8" in flat(script)  # 32768 MB / 8 CPUs
    for flag in ("--nv", "--bind /storage:/storage", "--bind /models:/models:ro", "/images/"):
        assert flag in script
    assert "SLURM_LOCALID" in script  # the GPU slice of each task
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid shell


def test_cpu_job_without_container(tmp_path):
    spec = SchedulingSpec(cpu=1, mem=0, container_type="none", mount="/storage:/storage")
    script = batch_script(make_job(tmp_path, spec, replicas=2))
    assert "--gres" not in script and "--nv" not in script and "--mem" not in script
    assert str(STANDIN) not in script and "--bind" not in script
    assert "bash -c" in script and '--chdir "${PWD}"' in flat(script)  # default srun args
    assert "export OMP_NUM_THREADS=1" in script  # exported inside the step instead of --env
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


SHOW_ENV = textwrap.dedent(
    """
    import json, os, sys
    names = ["A_SPACES", "A_LIST", "A_REF", "A_SUBST", "OMP_NUM_THREADS", "AREAL_RPC_TOKEN",
             "A_SECRET", "PWD"]
    print(json.dumps({"env": {n: os.environ.get(n) for n in names}, "argv": sys.argv[1:]}))
    """
)


def test_the_script_runs_with_a_fake_srun_and_the_container_stand_in(tmp_path):
    """Every value arrives intact, secrets come from the file, which is then removed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(
        "#!/bin/bash\n"
        "# skip srun's options (honouring --chdir) up to the step; run one labelled task\n"
        'while [ $# -gt 0 ] && [ "$1" != "$FAKE_SRUN_STEP" ]; do\n'
        '  if [ "$1" = --chdir ]; then cd "$2" || exit 1; shift; fi\n'
        "  shift\n"
        "done\n"
        "export SLURM_PROCID=0 SLURM_LOCALID=0\n"
        "\"$@\" 2>&1 | sed 's/^/0: /'\n"
    )
    srun.chmod(0o755)
    image = tmp_path / "image.sif"
    image.write_text("")
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    spec = SchedulingSpec(
        cpu=2,
        mem=1,
        image=str(image),
        mount=f"{tmp_path}:/data",
        cmd=f"{sys.executable} -c {shlex.quote(SHOW_ENV)}",
        env_vars={
            "A_SPACES": "two words 'and' \"quotes\"",
            "A_LIST": "x,y",
            "A_REF": "${A_CRED}-suffix",
            "A_SUBST": "$(touch pwned)",
            "A_SECRET": SecretStr("from-the-file"),
        },
        srun_additional_args=f"--chdir {shlex.quote(str(workdir))}",
    )
    job = make_job(tmp_path, spec)
    job.log_dir.mkdir()
    job.secrets_file.parent.mkdir()
    secrets = {RPC_TOKEN_ENV: "tok-123", **split_env(job.env, "apptainer")[2]}
    job.secrets_file.write_text(secrets_file_text(secrets))
    script = batch_script(job)
    assert "tok-123" not in script and "from-the-file" not in script
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_SRUN_STEP": sys.executable,
        "CONTAINER_STANDIN_LOG": str(tmp_path / "standin.jsonl"),
        "A_CRED": "cred",
    }
    subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, check=True, timeout=60)

    line = (job.log_dir / "merged.log").read_text().splitlines()[0]
    assert line.startswith("[actor/0] ")
    seen = json.loads(line.removeprefix("[actor/0] "))
    assert seen["env"] == {
        "A_SPACES": "two words 'and' \"quotes\"",
        "A_LIST": "x,y",
        "A_REF": "cred-suffix",
        "A_SUBST": "$(touch pwned)",
        "OMP_NUM_THREADS": "2",
        "AREAL_RPC_TOKEN": "tok-123",
        "A_SECRET": "from-the-file",
        "PWD": str(workdir),
    }
    assert seen["argv"] == ["--experiment-name", "exp", "--trial-name", "trial", "--role", "actor"]
    assert not (workdir / "pwned").exists() and not (tmp_path / "pwned").exists()
    assert not job.secrets_file.exists()  # read, then removed at job start
    assert (job.log_dir / "actor.log").read_text().startswith("0: {")

    call = json.loads((tmp_path / "standin.jsonl").read_text())
    assert call["binds"] == [f"{tmp_path}:/data"] and call["image"] == str(image)
    env_flags = [v for name, v in call["flags"] if name == "--env"]
    assert "A_SPACES=two words 'and' \"quotes\"" in env_flags
    assert not [v for v in env_flags if v.startswith(("A_LIST", "A_REF", "A_SECRET", "AREAL_RPC"))]
    assert "tok-123" not in json.dumps(call) and "cred" not in json.dumps(call["argv"])


# --- ending with the controller's Slurm job ---


def test_a_controller_outside_slurm_adds_no_comment_and_no_watcher(tmp_path):
    job = make_job(tmp_path, SchedulingSpec(cpu=1, mem=1, container_type="none"))
    assert not [o for o in sbatch_options(job) if o.startswith("--comment")]
    script = batch_script(job)
    assert "squeue" not in script and "scancel" not in script and "_areal" not in script


def test_a_controller_in_slurm_is_recorded_and_watched(tmp_path):
    job = make_job(tmp_path, SchedulingSpec(cpu=1, mem=1, container_type="none"))
    job = dataclasses.replace(job, controller_job="123", controller_poll=2.5)
    assert sbatch_options(job)[-1] == "--comment=areal-controller=123"  # squeue -o %k
    script = batch_script(job)
    lines = script.splitlines()
    assert "#SBATCH --comment=areal-controller=123" in lines
    assert "    while sleep 2.5; do" in lines
    assert "        if out=$(squeue -h -j 123 -o %T 2>&1); then" in lines
    assert '        scancel "$SLURM_JOB_ID"' in lines
    # the watcher starts before the step; the script ends with the step's status
    started = lines.index("_areal_watch_controller &")
    assert started < next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert lines[-3:] == [
        "_areal_status=$?",
        'kill "$_areal_watcher" 2>/dev/null',
        'exit "$_areal_status"',
    ]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    if shutil.which("shellcheck"):  # SC1091: the secrets file is not there to follow
        subprocess.run(["shellcheck", "-e", "SC1091", "-"], input=script, text=True, check=True)
    with pytest.raises(WorkerConfigurationError, match="not a number"):
        batch_script(dataclasses.replace(job, controller_job="1; rm -rf ~"))


WATCHER_CLIENTS = {
    # answers "RC|TEXT" lines in turn (TEXT on stdout if RC is 0, else on stderr), then
    # repeats the last one
    "squeue": textwrap.dedent(
        """\
        n=$(( $(cat "$FAKE_SLURM/count" 2>/dev/null || echo 0) + 1 ))
        echo "$n" > "$FAKE_SLURM/count"
        answer=$(sed -n "${n}p" "$FAKE_SLURM/answers")
        [ -n "$answer" ] || answer=$(tail -n 1 "$FAKE_SLURM/answers")
        if [ "${answer%%|*}" = 0 ]; then echo "${answer#*|}"; exit 0; fi
        echo "${answer#*|}" >&2; exit 1
        """
    ),
    "scancel": 'echo "$@" >> "$FAKE_SLURM/scancel.log"',
    # the step runs until the job is cancelled (at most 20 s), then exits with 7
    "srun": 'for _ in $(seq 200); do [ -e "$FAKE_SLURM/scancel.log" ] && break; sleep 0.1; '
    "done; echo step over; exit 7",
}
UNREACHABLE = "1|slurm_load_jobs error: Unable to contact slurm controller (connect failure)"


def run_watched_script(tmp_path: Path, answers: list[str], step: str | None = None):
    """Run a batch script watching controller job 123 (as job 555), with fake clients."""
    state = tmp_path / "fake-slurm"
    bin_dir = tmp_path / "fake-bin"
    for d in (state, bin_dir):
        d.mkdir()
    for name, body in {**WATCHER_CLIENTS, **({"srun": step} if step else {})}.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (state / "answers").write_text("\n".join(answers) + "\n")
    job = make_job(tmp_path, SchedulingSpec(cpu=1, mem=1, container_type="none"))
    job = dataclasses.replace(job, secrets_file=None, controller_job="123", controller_poll=0.1)
    job.log_dir.mkdir()
    result = subprocess.run(
        ["bash", "-c", batch_script(job)],
        env={
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "FAKE_SLURM": str(state),
            "SLURM_JOB_ID": "555",
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    calls = int((state / "count").read_text()) if (state / "count").exists() else 0
    scancel = state / "scancel.log"
    return result, calls, scancel.read_text() if scancel.exists() else None


@pytest.mark.parametrize(
    ("answers", "ended"),
    [
        # slurmctld away, then the job still runs: keep polling; then Slurm forgot it
        (
            [UNREACHABLE, "0|RUNNING", "1|slurm_load_jobs error: Invalid job id specified"],
            "no longer in the queue",
        ),
        (["0|PENDING", "0|CANCELLED"], "CANCELLED"),
        (["0|RUNNING", "0|NODE_FAIL"], "NODE_FAIL"),
        (["0|RUNNING", "0|"], "no longer in the queue"),  # squeue lists it no more
    ],
)
def test_the_watcher_cancels_the_job_once_the_controller_job_is_over(tmp_path, answers, ended):
    result, calls, scancel = run_watched_script(tmp_path, answers)
    assert scancel == "555\n"  # this job, with scancel's default SIGTERM
    assert calls == len(answers)  # one squeue per poll, none after the cancel
    assert f"controller job 123 has ended ({ended}); cancelling this worker job" in result.stdout
    assert result.returncode == 7  # the step's status


def test_the_watcher_never_cancels_while_squeue_fails_or_the_controller_runs(tmp_path):
    # the step ends by itself after ~1 s (10 polls): the watcher is stopped, not left behind
    step = "sleep 1; exit 3"
    result, calls, scancel = run_watched_script(tmp_path, [UNREACHABLE, "0|RUNNING"], step)
    assert scancel is None and "has ended" not in result.stdout
    assert calls >= 3
    assert result.returncode == 3


# --- capacity of the partition ---

NODES = ["n1|8|64000|gpu:8", "n2|8|64000|gpu:h200:8(S:0-1)", "n3|4+|16000|(null)"]


def resources(nodes: int = 2, tasks: int = 4, cpus: int = 2, gpus: int = 8, **kw) -> SlurmResources:
    return SlurmResources(
        nodes=nodes,
        ntasks=nodes * tasks,
        ntasks_per_node=tasks,
        cpus_per_task=cpus,
        mem_per_task_mb=1024,
        gpus_per_task=gpus // tasks,
        gres_gpus_per_node=gpus,
        **kw,
    )


def split(hostlist: str) -> list[str]:
    return hostlist.split(",")


def test_capacity_problem_compares_the_request_with_every_node():
    # 2 nodes of 4 tasks x 2 CPUs (8 CPUs), 4096 MB and 8 GPUs: n1 and n2 fit
    assert capacity_problem(resources(), NODES, "gpu", split) is None
    problem = capacity_problem(resources(nodes=3), NODES, "gpu", split)
    assert problem.startswith("partition gpu has 2 node(s) with at least 8 CPUs, 4096 MB")
    assert "needs 3" in problem
    assert "has 1 node(s)" in capacity_problem(resources(exclude="n1"), NODES, "gpu", split)
    problem = capacity_problem(resources(nodes=1, nodelist="n3"), NODES, "gpu", split)
    assert problem == "nodelist node(s) n3 have less than 8 CPUs, 4096 MB memory and 8 GPUs"
    problem = capacity_problem(resources(nodes=1, nodelist="n9"), NODES, "gpu", split)
    assert problem == "nodelist names n9, not in partition gpu"
    cpu_only = resources(nodes=1, tasks=1, cpus=16, gpus=0)
    assert "largest node has 8 CPUs, 64000 MB, 8 GPUs" in capacity_problem(
        cpu_only, NODES, "gpu", split
    )
    assert capacity_problem(resources(nodes=5), [], "gpu", split) is None  # nothing known


# --- the scheduler against fake Slurm clients ---

FAKE_CLIENTS = {
    "sbatch": 'echo "$@" >> "$FAKE_SLURM/sbatch.log"; echo 4242',
    # squeue -u (jobs a dead controller left): none
    "squeue": 'if [ "$2" = -u ]; then exit 0; fi; cat "$FAKE_SLURM/squeue"',
    "scancel": 'echo "$@" >> "$FAKE_SLURM/scancel.log"; '
    'echo "CANCELLED|None|n1|debug" > "$FAKE_SLURM/squeue"',
    "sinfo": 'cat "$FAKE_SLURM/sinfo"',
    "scontrol": 'if [ "$2" = hostnames ]; then echo "$3"; else echo "JobId=4242 ExitCode=0:0"; fi',
}


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for name, body in FAKE_CLIENTS.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    state = tmp_path / "fake-slurm"
    state.mkdir()
    (state / "squeue").write_text("PENDING|None||debug\n")
    (state / "sinfo").write_text("n1|8|16000|(null)\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM", str(state))
    monkeypatch.setenv(RPC_TOKEN_ENV, "fake-token-1")
    yield state
    name_resolve.reconfigure("memory")


def make_config(root: Path) -> BaseExperimentConfig:
    return BaseExperimentConfig(
        experiment_name="exp",
        trial_name="trial",
        cluster=ClusterSpecConfig(
            fileroot=str(root / "files"),
            n_gpus_per_node=8,
            name_resolve=NameResolveConfig(nfs_record_root=str(root / "nr")),
        ),
    )


def test_a_job_that_turns_out_impossible_while_waiting_is_cancelled(fake_slurm, tmp_path):
    sched = SlurmScheduler(make_config(tmp_path), status_ttl=0.0)
    spec = SchedulingSpec(cpu=4, mem=1, container_type="none")
    assert sched.create_workers(Job("actor", 3, [spec])) == ["actor/0", "actor/1", "actor/2"]
    assert sched.job_ids() == {"actor": "4242"}
    secrets_file = sched.log_dir / ".secrets" / "actor.env"
    assert stat.S_IMODE(secrets_file.stat().st_mode) == 0o600
    assert "fake-token-1" in secrets_file.read_text()
    assert "fake-token-1" not in (sched.log_dir / "actor.sh").read_text()

    # the scheduler only later gives a reason; the capacity check names the shortfall
    (fake_slurm / "squeue").write_text("PENDING|Resources||debug\n")
    with pytest.raises(WorkerCreationError) as info:
        sched.get_workers("actor", timeout=30)
    message = str(info.value)
    assert message.startswith("Slurm job 4242 (exp_trial:actor) for role 'actor' can never start")
    assert "reason Resources: partition debug has 0 node(s) with at least 12 CPUs" in message
    assert (fake_slurm / "scancel.log").read_text() == "4242\n"
    sched.delete_workers()
    assert not secrets_file.exists()


def test_a_job_slurm_knows_is_impossible_fails_at_creation(fake_slurm, tmp_path):
    (fake_slurm / "squeue").write_text("PENDING|PartitionConfig||debug\n")
    sched = SlurmScheduler(make_config(tmp_path))
    with pytest.raises(WorkerCreationError, match="PartitionConfig"):
        sched.create_workers(Job("actor", 1, [SchedulingSpec(cpu=1, mem=1)]))
    assert sched.job_ids() == {}
    assert list((sched.log_dir / ".secrets").glob("*")) == []
    # sbatch got the script and no secret through its environment or arguments
    assert (fake_slurm / "sbatch.log").read_text().split() == [
        "--parsable",
        str(sched.log_dir / "actor.sh"),
    ]
    with pytest.raises(WorkerConfigurationError, match="specs must be equal"):
        sched.create_workers(Job("mixed", 2, [SchedulingSpec(cpu=1), SchedulingSpec(cpu=2)]))
    sched.delete_workers()


def test_missing_slurm_clients_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SchedulerError, match="missing: sbatch, squeue, scancel"):
        SlurmScheduler(make_config(tmp_path))


def test_config_secrets_reach_workers_through_the_secrets_file_only(fake_slurm, tmp_path):
    base = make_config(tmp_path)
    config = PPOConfig(
        experiment_name=base.experiment_name, trial_name=base.trial_name, cluster=base.cluster
    )
    config.stats_logger.wandb.wandb_api_key = SecretStr("wandb-sentinel-42")
    config.rollout.agent.admin_api_key = SecretStr("admin-sentinel-42")
    sched = SlurmScheduler(config)
    spec = SchedulingSpec(cpu=1, mem=1, container_type="none")
    sched.create_workers(Job("actor", 1, [spec]))
    sched.create_workers(Job("rollout", 1, [spec], secrets="rollout"))
    actor_text = (sched.log_dir / ".secrets" / "actor.env").read_text()
    rollout_text = (sched.log_dir / ".secrets" / "rollout.env").read_text()
    # each role's file holds what that role uses; the logger key stays on the controller
    assert "AREAL_SECRET_ROLLOUT_AGENT_ADMIN_API_KEY" in rollout_text
    assert "admin-sentinel-42" in rollout_text and "admin-sentinel-42" not in actor_text
    assert "wandb-sentinel-42" not in actor_text + rollout_text
    for role in ("actor", "rollout"):
        assert "admin-sentinel-42" not in (sched.log_dir / f"{role}.sh").read_text()
    assert "admin-sentinel-42" not in (fake_slurm / "sbatch.log").read_text()
    sched.delete_workers()
    assert not list((sched.log_dir / ".secrets").glob("*.env"))  # removed at teardown


def test_a_controller_in_slurm_records_its_job_in_every_worker_job(
    fake_slurm, tmp_path, monkeypatch
):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    sched = SlurmScheduler(make_config(tmp_path))
    spec = SchedulingSpec(cpu=1, mem=1, container_type="none")
    sched.create_workers(Job("actor", 1, [spec]))
    sched.controller_poll = 1.5
    sched.create_workers(Job("rollout", 1, [spec]))
    actor = (sched.log_dir / "actor.sh").read_text().splitlines()
    rollout = (sched.log_dir / "rollout.sh").read_text().splitlines()
    for lines in (actor, rollout):
        assert "#SBATCH --comment=areal-controller=77" in lines
        assert "        if out=$(squeue -h -j 77 -o %T 2>&1); then" in lines
    assert "    while sleep 10; do" in actor  # the default poll
    assert "    while sleep 1.5; do" in rollout
    sched.delete_workers()

    monkeypatch.delenv("SLURM_JOB_ID")
    sched = SlurmScheduler(make_config(tmp_path))
    sched.create_workers(Job("actor", 1, [spec]))
    script = (sched.log_dir / "actor.sh").read_text()
    assert "--comment" not in script and "squeue" not in script
    sched.delete_workers()


# --- jobs a dead controller of the same trial left ---


def completed(args: tuple[str, ...], rc: int = 0, out: str = "", err: str = ""):
    return subprocess.CompletedProcess(list(args), rc, out, err)


class FakeQueue:
    """Stands in for ``SlurmScheduler._slurm``: a queue of jobs (id -> name, comment,
    state) that sbatch adds to and scancel ends; every call is recorded."""

    def __init__(self, jobs: dict[str, tuple[str, str, str]]):
        self.jobs = dict(jobs)
        self.calls: list[tuple[str, ...]] = []
        self.unreachable = False  # squeue -j fails as with slurmctld away
        self.next_id = 100

    def __call__(self, *args: str, check: bool = True, timeout: float = 30.0):
        self.calls.append(args)
        command, options = args[0], args[1:]
        if command == "sbatch":  # the job's name and comment come from the script
            lines = Path(args[-1]).read_text().splitlines()
            sbatch = dict(
                line.removeprefix("#SBATCH --").split("=", 1)
                for line in lines
                if line.startswith("#SBATCH --") and "=" in line
            )
            job_id, self.next_id = str(self.next_id), self.next_id + 1
            self.jobs[job_id] = (sbatch["job-name"], sbatch.get("comment", "(null)"), "PENDING")
            return completed(args, out=f"{job_id}\n")
        if command == "scancel":
            for job_id in options:
                if job_id in self.jobs:
                    name, comment, _ = self.jobs[job_id]
                    self.jobs[job_id] = (name, comment, "CANCELLED")
            return completed(args)
        if command == "squeue" and "-u" in options:  # the active jobs, as squeue lists them
            rows = [
                f"{job_id}|{name}|{comment}|{state}"
                for job_id, (name, comment, state) in self.jobs.items()
                if state in ("PENDING", "RUNNING", "COMPLETING")
            ]
            return completed(args, out="".join(f"{row}\n" for row in rows))
        if command == "squeue" and "-j" in options:  # is a controller's job over?
            if self.unreachable:
                return completed(args, 1, err="slurm_load_jobs error: Unable to contact")
            job = self.jobs.get(options[options.index("-j") + 1])
            if job is None:
                return completed(args, 1, err="slurm_load_jobs error: Invalid job id specified")
            return completed(args, out=f"{job[2]}\n")
        if command == "squeue":  # the scheduler's own status query (--states=all)
            job_id = next(o for o in options if o.startswith("--jobs=")).removeprefix("--jobs=")
            return completed(args, out=f"{self.jobs[job_id][2]}|None|n1|debug\n")
        raise AssertionError(f"unexpected Slurm call {args}")

    def index(self, command: str, *options: str) -> int:
        """Position of the first call of ``command`` with ``options`` (-1 if none)."""
        for i, call in enumerate(self.calls):
            if call[0] == command and all(o in call for o in options):
                return i
        return -1


def leftover_queue(controller_state: str | None, comment: str = "areal-controller=7"):
    """Two workers of trial exp/trial from controller job 7, and jobs of other trials."""
    jobs = {
        "11": ("exp_trial:actor", comment, "RUNNING"),
        "12": ("exp_trial:rollout", comment, "PENDING"),
        "13": ("exp_trial2:actor", "areal-controller=8", "RUNNING"),  # another trial
        "14": ("exp_trial", "(null)", "RUNNING"),  # not named {exp}_{trial}:{role}
    }
    if controller_state is not None:
        jobs["7"] = ("trainer", "(null)", controller_state)
    return FakeQueue(jobs)


CPU_SPEC = SchedulingSpec(cpu=1, mem=1, container_type="none")


@pytest.mark.parametrize(
    ("controller_state", "own_job", "how"),
    [
        (None, None, "no longer in the queue"),  # Slurm forgot the controller's job
        ("COMPLETING", None, "COMPLETING"),
        ("RUNNING", "7", "this controller's own job, in an earlier run"),
    ],
)
def test_leftovers_of_an_ended_controller_are_cancelled_before_the_first_sbatch(
    fake_slurm, tmp_path, monkeypatch, areal_logs, controller_state, own_job, how
):
    if own_job is None:
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    else:
        monkeypatch.setenv("SLURM_JOB_ID", own_job)
    sched = SlurmScheduler(make_config(tmp_path))
    queue = leftover_queue(controller_state)
    sched._slurm = queue
    assert sched.create_workers(Job("actor", 1, [CPU_SPEC])) == ["actor/0"]

    user = pwd.getpwuid(os.getuid()).pw_name  # the OS user, whose jobs squeue -u lists
    assert queue.calls[0] == ("squeue", "-h", "-u", user, "-o", "%i|%j|%k|%T")
    assert 0 < queue.index("scancel", "11", "12") < queue.index("sbatch")
    assert queue.index("squeue", "-j", "7") == (-1 if own_job else 1)
    assert [queue.jobs[i][2] for i in ("11", "12", "13", "14")] == [
        "CANCELLED",
        "CANCELLED",
        "RUNNING",
        "RUNNING",
    ]
    warnings = [r.getMessage() for r in areal_logs.records if r.levelname == "WARNING"]
    [warning] = [w for w in warnings if "left by" in w]  # not the local-storage notes
    assert warning == (
        f"Trial exp/trial: cancelling Slurm job(s) 11, 12 left by controller job(s) 7 ({how})"
    )
    # the check runs once per scheduler
    sched.create_workers(Job("rollout", 1, [CPU_SPEC]))
    assert [c for c in queue.calls if c[0] == "squeue" and "-u" in c] == [queue.calls[0]]
    sched.delete_workers()


def test_leftovers_of_a_live_controller_stop_the_new_one(fake_slurm, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "9")  # in a Slurm job, but not the one that owns them
    sched = SlurmScheduler(make_config(tmp_path))
    queue = leftover_queue("RUNNING")
    sched._slurm = queue
    with pytest.raises(SchedulerError) as info:
        sched.create_workers(Job("actor", 1, [CPU_SPEC]))
    assert str(info.value) == (
        "trial exp/trial already has Slurm job(s) 11, 12 of a controller that still runs "
        "(Slurm job 7); `scancel 7` first, or choose another trial_name"
    )
    queue.unreachable = True  # squeue cannot tell: no guess either way
    with pytest.raises(SchedulerError, match="cannot tell whether controller job 7 still runs"):
        sched.create_workers(Job("actor", 1, [CPU_SPEC]))
    assert queue.index("sbatch") == queue.index("scancel") == -1
    assert sched.job_ids() == {}
    assert list((sched.log_dir / ".secrets").glob("*.env")) == []

    # once the user cancelled the other controller, the next try cancels its workers
    queue.unreachable = False
    queue.jobs["7"] = ("trainer", "(null)", "CANCELLED")
    assert sched.create_workers(Job("actor", 1, [CPU_SPEC])) == ["actor/0"]
    assert queue.index("scancel", "11", "12") < queue.index("sbatch")
    sched.delete_workers()


def test_leftovers_without_a_recorded_controller_stop_the_new_one(fake_slurm, tmp_path):
    sched = SlurmScheduler(make_config(tmp_path))
    queue = leftover_queue(None, comment="(null)")  # submitted by a controller outside Slurm
    sched._slurm = queue
    with pytest.raises(SchedulerError) as info:
        sched.create_workers(Job("actor", 1, [CPU_SPEC]))
    assert str(info.value) == (
        "trial exp/trial already has Slurm job(s) 11, 12 from a controller that ran outside "
        "Slurm, so whether it still runs cannot be told; if it is gone, run `scancel 11 12`, "
        "otherwise choose another trial_name"
    )
    assert queue.index("sbatch") == queue.index("scancel") == -1
    assert queue.jobs["11"][2] == "RUNNING"
    sched.delete_workers()
