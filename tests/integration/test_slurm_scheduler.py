"""SlurmScheduler on a real single-node Slurm cluster (see tests/slurm_cluster.py).

Workers run the real RPC server. Roles with ``container_type: apptainer`` go through the
container stand-in (tests/fakes/container_standin.py, set as ``AREAL_CONTAINER_BIN``),
which logs the exact flags, binds, image and command apptainer would have been given.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from areal.api.cli_args import (
    BaseExperimentConfig,
    ClusterSpecConfig,
    NameResolveConfig,
    SchedulingSpec,
    SchedulingStrategy,
)
from areal.api.scheduler_api import RPC_TOKEN_ENV, Job
from areal.infra.rpc.processes import descendant_pids, process_alive
from areal.infra.scheduler.exceptions import WorkerCreationError, WorkerFailedError
from areal.infra.scheduler.slurm import SlurmScheduler
from areal.utils import name_resolve
from tests.helpers.rpc_health import signed_health
from tests.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

REPO_ROOT = Path(__file__).resolve().parents[2]
STANDIN = REPO_ROOT / "tests" / "fakes" / "container_standin.py"
ECHO = "tests.unit.infra.fake_engines.EchoEngine"
RPC_SERVER = f"{sys.executable} -m areal.infra.rpc.rpc_server"
STARTUP = 90.0
CREDENTIAL = "cred-sentinel-5d1e"  # in the submit environment, referenced as $NAME
TOKEN = "rpc-token-sentinel-" + os.urandom(8).hex()


def make_config(root: Path) -> BaseExperimentConfig:
    return BaseExperimentConfig(
        experiment_name="exp",
        trial_name="trial",
        cluster=ClusterSpecConfig(
            fileroot=str(root / "files"),
            n_gpus_per_node=0,
            name_resolve=NameResolveConfig(nfs_record_root=str(root / "name_resolve")),
        ),
    )


@pytest.fixture
def submit_env(slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The controller's environment: the cluster, the container stand-in, a token."""
    monkeypatch.chdir(REPO_ROOT)  # workers import tests.* through the controller's cwd
    # a controller that already holds a token exports its environment to sbatch: the
    # scheduler must keep the token out of what Slurm stores with the job
    monkeypatch.setenv(RPC_TOKEN_ENV, TOKEN)
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AREAL_CONTAINER_BIN", f"{sys.executable} {STANDIN}")
    monkeypatch.setenv("CONTAINER_STANDIN_LOG", str(tmp_path / "standin.jsonl"))
    monkeypatch.setenv("AREAL_TEST_CREDENTIAL", CREDENTIAL)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # a controller outside Slurm
    yield
    name_resolve.reconfigure("memory")


@pytest.fixture
def scheduler(submit_env: None, tmp_path: Path):
    sched = SlurmScheduler(make_config(tmp_path), stop_grace=5.0)
    yield sched
    sched.delete_workers()


def create_engines(sched: SlurmScheduler, worker_ids: list[str]) -> None:
    async def create() -> None:
        await asyncio.gather(*(sched.create_engine(w, ECHO) for w in worker_ids))

    asyncio.run(create())


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def all_cmdlines() -> bytes:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out.append(Path(f"/proc/{entry}/cmdline").read_bytes())
            except OSError:
                continue
    return b"\n".join(out)


def files_containing(root: Path, needle: bytes) -> list[Path]:
    hits = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and needle in path.read_bytes():
                hits.append(path)
        except OSError:
            continue
    return hits


def test_roles_fork_alias_container_flags_and_private_token(
    scheduler: SlurmScheduler,
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
):
    image = tmp_path / "areal.sif"
    image.write_text("stand-in image")
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    marker = tmp_path / "substituted"
    actor_spec = SchedulingSpec(
        cpu=1,
        gpu=0,
        mem=1,
        port_count=2,
        image=str(image),
        cmd=RPC_SERVER,
        mount=f"{tmp_path}:/data,/opt/models:/models:ro",
        env_vars={
            "AREAL_TEST_SPACES": 'two words and "quotes"',
            "AREAL_TEST_LIST": "a,b,c",
            "AREAL_TEST_CREDENTIAL_COPY": "$AREAL_TEST_CREDENTIAL",
            "AREAL_TEST_NO_SUBST": f"$(touch {marker}) `touch {marker}`",
        },
        srun_additional_args=(
            f"--unbuffered -K --chdir {shlex.quote(str(workdir))} "
            "--export=ALL,AREAL_TEST_SRUN_MARK=from-srun-args"
        ),
    )
    # the default srun_additional_args (--mpi=pmi2 -K --chdir $PWD), no container
    rollout_spec = SchedulingSpec(cpu=1, mem=1, port_count=1, cmd=RPC_SERVER, container_type="none")
    assert scheduler.create_workers(Job("actor", 2, [actor_spec])) == ["actor/0", "actor/1"]
    assert scheduler.create_workers(Job("rollout", 1, [rollout_spec])) == ["rollout/0"]
    actors = scheduler.get_workers("actor", timeout=STARTUP)
    rollouts = scheduler.get_workers("rollout", timeout=STARTUP)
    assert len(actors[0].worker_ports) == 2 and actors[0].engine_ports == actors[0].worker_ports[1:]
    assert rollouts[0].engine_ports == []
    jobs = scheduler.job_ids()
    assert set(jobs) == {"actor", "rollout"}
    queue = slurm_cluster.client("squeue", "--noheader", "--format=%i|%j|%T").stdout
    assert f"{jobs['actor']}|exp_trial:actor|RUNNING" in queue

    # --- engines and the environment each worker got ---
    create_engines(scheduler, ["actor/0", "actor/1", "rollout/0"])
    assert scheduler.call_engine("actor/1", "add", 2, b=3) == 5

    def env_of(worker: str, name: str):
        return scheduler.call_engine(worker, "get_env", name)

    assert [env_of(w, "SLURM_PROCID") for w in ("actor/0", "actor/1")] == ["0", "1"]
    assert env_of("actor/0", "AREAL_TEST_SPACES") == 'two words and "quotes"'
    assert env_of("actor/0", "AREAL_TEST_LIST") == "a,b,c"
    assert env_of("actor/1", "AREAL_TEST_CREDENTIAL_COPY") == CREDENTIAL
    assert env_of("actor/0", "AREAL_TEST_NO_SUBST") == f"$(touch {marker}) `touch {marker}`"
    assert not marker.exists()
    assert env_of("actor/0", "OMP_NUM_THREADS") == "1"  # = cpus per task
    assert str(REPO_ROOT) in env_of("actor/0", "PYTHONPATH")
    assert env_of("actor/0", "AREAL_TEST_SRUN_MARK") == "from-srun-args"  # srun args honoured
    assert env_of("actor/0", "PWD") == str(workdir)
    assert env_of("rollout/0", "AREAL_TEST_SPACES") is None
    assert env_of("rollout/0", "PWD") == str(REPO_ROOT)  # --chdir $PWD of the default args

    # --- what the container binary was asked to do ---
    calls = [json.loads(line) for line in (tmp_path / "standin.jsonl").read_text().splitlines()]
    assert len(calls) == 2  # one per actor task; the rollout role runs without a container
    for call in calls:
        assert call["image"] == str(image)
        assert call["binds"] == [f"{tmp_path}:/data", "/opt/models:/models:ro"]
        assert call["cwd"] == str(workdir)
        assert call["command"][:2] == ["bash", "-c"]
        flags = [tuple(f) for f in call["flags"]]
        assert ("--no-home", None) in flags and ("--writable-tmpfs", None) in flags
        assert ("--nv", None) not in flags  # no GPUs asked for
        env_flags = dict(v.split("=", 1) for name, v in flags if name == "--env")
        assert env_flags["AREAL_TEST_SPACES"] == 'two words and "quotes"'
        assert env_flags["OMP_NUM_THREADS"] == "1"
        # references and commas are exported inside the container, not passed as flags
        assert "AREAL_TEST_CREDENTIAL_COPY" not in env_flags
        assert "AREAL_TEST_LIST" not in env_flags
        assert RPC_TOKEN_ENV not in env_flags
    assert CREDENTIAL not in (tmp_path / "standin.jsonl").read_text()

    # --- colocation: forked processes and an alias ---
    fork = SchedulingStrategy(type="colocation", target="actor", fork=True)
    assert scheduler.create_workers(Job("ref", 2, [actor_spec], fork)) == ["ref/0", "ref/1"]
    alias = SchedulingStrategy(type="colocation", target="actor", fork=False)
    assert scheduler.create_workers(Job("critic", 2, [actor_spec], alias)) == [
        "critic/0",
        "critic/1",
    ]
    assert len(scheduler.get_workers("ref")[0].engine_ports) == 1  # as many as the target
    create_engines(scheduler, ["ref/0", "ref/1", "critic/0"])
    assert scheduler.call_engine("ref/1", "add", 1, 1) == 2
    pids = {w: scheduler.call_engine(w, "pid") for w in ("actor/0", "actor/1", "ref/0", "ref/1")}
    assert len(set(pids.values())) == 4
    assert scheduler.call_engine("critic/0", "pid") == pids["actor/0"]
    assert env_of("ref/1", "SLURM_PROCID") == "1"  # forked next to actor/1
    assert scheduler.job_ids().keys() == {"actor", "rollout"}  # colocation adds no job

    # --- the RPC token: in the workers' environment, nowhere else ---
    token = scheduler.rpc_token.reveal().encode()
    assert token == TOKEN.encode()
    assert token in Path(f"/proc/{pids['actor/0']}/environ").read_bytes()
    assert token in Path(f"/proc/{pids['ref/1']}/environ").read_bytes()
    for job_id in jobs.values():
        script = slurm_cluster.client("scontrol", "write", "batch_script", job_id, "-").stdout
        assert "srun" in script and token.decode() not in script
        shown = slurm_cluster.client("scontrol", "show", "job", "--details", job_id).stdout
        assert f"JobId={job_id}" in shown and token.decode() not in shown
    assert token not in all_cmdlines()
    assert files_containing(slurm_cluster.root, token) == []  # not even the stored job env
    assert files_containing(scheduler.log_dir, token) == []  # secrets file read and removed
    assert list(scheduler.log_dir.glob(".secrets/*")) == []

    # --- logs: role.log and merged.log with per-task prefixes ---
    scheduler.call_engine("actor/1", "say", "hello from actor 1")
    merged = scheduler.log_dir / "merged.log"
    assert wait_until(lambda: "[actor/1] hello from actor 1" in merged.read_text())
    assert "hello from actor 1" in (scheduler.log_dir / "actor.log").read_text()

    # --- teardown leaves nothing in the queue and no worker process ---
    scheduler.delete_workers()
    assert slurm_cluster.job_ids() == []
    assert wait_until(lambda: not any(process_alive(p) for p in pids.values()))


def test_colocation_with_other_replica_count_pins_the_nodes_and_a_cancelled_job_fails(
    scheduler: SlurmScheduler,
    slurm_cluster: SlurmCluster,
):
    spec = SchedulingSpec(cpu=1, mem=1, port_count=1, cmd=RPC_SERVER, container_type="none")
    scheduler.create_workers(Job("actor", 1, [spec]))
    strategy = SchedulingStrategy(type="colocation", target="actor")
    assert scheduler.create_workers(Job("proxy", 2, [spec], strategy)) == ["proxy/0", "proxy/1"]
    job_id = scheduler.job_ids()["proxy"]
    shown = slurm_cluster.client("scontrol", "--oneliner", "show", "job", job_id).stdout
    assert f"ReqNodeList={slurm_cluster.node} " in shown and "gres" not in shown
    scheduler.get_workers("proxy", timeout=STARTUP)
    create_engines(scheduler, ["proxy/0", "proxy/1"])
    assert scheduler.call_engine("proxy/1", "add", 20, 22) == 42

    scheduler.call_engine("proxy/0", "say", "last words of proxy 0")
    slurm_cluster.client("scancel", job_id)
    assert wait_until(lambda: job_id not in slurm_cluster.job_ids())
    with pytest.raises(WorkerFailedError) as info:
        scheduler.call_engine("proxy/0", "add", 1, 2, retry_delay=0.2)
    assert info.value.worker_id == "proxy/0"
    assert f"Slurm job {job_id} (exp_trial:proxy) is CANCELLED" in info.value.logs
    assert "last words of proxy 0" in info.value.logs
    scheduler.delete_workers()
    assert slurm_cluster.job_ids() == []


def test_one_forked_server_spans_both_actor_workers_without_a_new_job(
    scheduler: SlurmScheduler,
    slurm_cluster: SlurmCluster,
):
    # the node has no GPUs: each actor task plays "GPU <its local id>", as Slurm's
    # gres selection would have set it (slurm_batch.gpu_selection)
    spec = SchedulingSpec(
        cpu=1,
        mem=1,
        port_count=2,
        cmd=RPC_SERVER,
        container_type="none",
        additional_bash_cmds=["export CUDA_VISIBLE_DEVICES=$SLURM_LOCALID"],
    )
    scheduler.create_workers(Job("actor", 2, [spec]))
    actors = {w.id: w for w in scheduler.get_workers("actor", timeout=STARTUP)}
    assert [signed_health(scheduler, actors[w])["visible_devices"] for w in sorted(actors)] == [
        "0",
        "1",
    ]

    fork = SchedulingStrategy(type="colocation", target="actor", fork=True)
    rollout_spec = SchedulingSpec(cpu=1, mem=1, cmd=RPC_SERVER, container_type="none")
    assert scheduler.create_workers(Job("rollout", 1, [rollout_spec], fork)) == ["rollout/0"]
    [rollout] = scheduler.get_workers("rollout")
    assert rollout.id == "rollout/0" and len(rollout.engine_ports) == 1  # as the target
    assert scheduler.job_ids().keys() == {"actor"}  # no Slurm job for the rollout
    assert len(slurm_cluster.job_ids()) == 1

    health = signed_health(scheduler, rollout)
    assert health["visible_devices"] == "0,1"  # both workers' devices, in order
    assert [signed_health(scheduler, actors[w])["forked_children"] for w in sorted(actors)] == [
        1,
        0,
    ]
    create_engines(scheduler, ["actor/0", "actor/1", "rollout/0"])
    pids = {w: scheduler.call_engine(w, "pid") for w in ("actor/0", "actor/1", "rollout/0")}
    assert pids["rollout/0"] in descendant_pids(pids["actor/0"])  # forked by actor/0
    assert scheduler.call_engine("rollout/0", "get_env", "SLURM_PROCID") == "0"
    assert scheduler.call_engine("rollout/0", "get_env", "CUDA_VISIBLE_DEVICES") == "0,1"
    assert scheduler.call_engine("actor/1", "get_env", "CUDA_VISIBLE_DEVICES") == "1"

    scheduler.delete_workers()
    assert slurm_cluster.job_ids() == []
    assert wait_until(lambda: not any(process_alive(p) for p in pids.values()))


def test_impossible_requests_fail_fast_with_the_job_and_the_reason(
    scheduler: SlurmScheduler,
    slurm_cluster: SlurmCluster,
):
    # Slurm accepts this job and would leave it PENDING (PartitionConfig) forever
    too_many_cpus = SchedulingSpec(cpu=2 * slurm_cluster.cpus, mem=1, container_type="none")
    start = time.monotonic()
    with pytest.raises(WorkerCreationError) as info:
        scheduler.create_workers(Job("huge", 1, [too_many_cpus]))
        scheduler.get_workers("huge", timeout=STARTUP)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "exp_trial:huge" in message and "'huge'" in message
    assert "can never start" in message and "PartitionConfig" in message
    assert f"{2 * slurm_cluster.cpus} CPUs" in message  # what no node of the partition has
    assert wait_until(lambda: slurm_cluster.job_ids() == [])  # cancelled, not left queued

    # sbatch itself refuses a memory request larger than any node
    too_much_memory = SchedulingSpec(cpu=1, mem=4 * slurm_cluster.memory_mb // 1024)
    with pytest.raises(WorkerCreationError, match=r"sbatch rejected role 'fat'.*Memory"):
        scheduler.create_workers(Job("fat", 1, [too_much_memory]))

    # neither attempt took the role name
    fits = SchedulingSpec(cpu=1, mem=1, cmd=RPC_SERVER, container_type="none")
    assert scheduler.create_workers(Job("huge", 1, [fits])) == ["huge/0"]
    scheduler.delete_workers()
    assert slurm_cluster.job_ids() == []


def test_dead_role_log_reaches_the_error(scheduler: SlurmScheduler):
    crash = SchedulingSpec(
        cpu=1, mem=1, container_type="none", cmd=f"{sys.executable} -c 'import sys; sys.exit(3)'"
    )
    scheduler.create_workers(Job("crash", 1, [crash]))
    with pytest.raises(WorkerFailedError) as info:
        scheduler.get_workers("crash", timeout=STARTUP)
    assert info.value.exit_code == 3
    assert "FAILED" in info.value.logs


# --- a killed controller's workers ---

CPU_WORKER = SchedulingSpec(cpu=1, mem=1, cmd=RPC_SERVER, container_type="none")


def submit_controller(slurm_cluster: SlurmCluster, tmp_path: Path) -> str:
    """A stand-in for the controller's own Slurm job."""
    out = slurm_cluster.client(
        "sbatch",
        "--parsable",
        "--job-name=trainer",
        f"--output={tmp_path / 'trainer.out'}",
        "--wrap",
        "sleep 600",
    )
    return out.stdout.strip().split(";")[0]


def test_a_worker_job_ends_with_its_controller_job(
    submit_env: None,
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    controller = submit_controller(slurm_cluster, tmp_path)
    sched = None
    try:
        monkeypatch.setenv("SLURM_JOB_ID", controller)  # the controller runs in that job
        sched = SlurmScheduler(make_config(tmp_path), stop_grace=5.0)
        sched.controller_poll = 1.0
        sched.create_workers(Job("actor", 1, [CPU_WORKER]))
        worker = sched.job_ids()["actor"]
        queue = slurm_cluster.client("squeue", "--noheader", "--format=%i|%k").stdout
        assert f"{worker}|areal-controller={controller}" in queue.split()

        slurm_cluster.client("scancel", controller)  # the controller is killed: no cleanup
        assert wait_until(lambda: worker not in slurm_cluster.job_ids(), timeout=30)
        log = (sched.log_dir / "actor.log").read_text()
        assert f"controller job {controller} has ended" in log
    finally:
        slurm_cluster.client("scancel", controller, check=False)
        if sched is not None:
            sched.delete_workers()
    assert wait_until(lambda: slurm_cluster.job_ids() == [])


def test_a_new_controller_cancels_the_workers_a_dead_one_left(
    submit_env: None,
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    areal_logs: pytest.LogCaptureFixture,
):
    controller = submit_controller(slurm_cluster, tmp_path)
    schedulers: list[SlurmScheduler] = []
    try:
        monkeypatch.setenv("SLURM_JOB_ID", controller)
        old = SlurmScheduler(make_config(tmp_path), stop_grace=5.0)
        schedulers.append(old)
        old.controller_poll = 600.0  # the worker's own watcher must not be what ends it
        old.create_workers(Job("actor", 1, [CPU_WORKER]))
        leftover = old.job_ids()["actor"]
        slurm_cluster.client("scancel", controller)  # killed, its workers left behind
        assert wait_until(lambda: controller not in slurm_cluster.job_ids())
        assert leftover in slurm_cluster.job_ids()

        monkeypatch.delenv("SLURM_JOB_ID")  # resubmitted, this time outside Slurm
        new = SlurmScheduler(make_config(tmp_path), stop_grace=5.0)
        schedulers.append(new)
        new.create_workers(Job("actor", 1, [CPU_WORKER]))
        assert slurm_cluster.job_ids() == [new.job_ids()["actor"]]
        assert new.job_ids()["actor"] != leftover
        warnings = [r.getMessage() for r in areal_logs.records if "left by" in r.getMessage()]
        assert warnings == [
            f"Trial exp/trial: cancelling Slurm job(s) {leftover} left by controller job(s) "
            f"{controller} (no longer in the queue)"
        ]
        new.get_workers("actor", timeout=STARTUP)  # its worker registers and comes up
    finally:
        slurm_cluster.client("scancel", controller, check=False)
        for sched in schedulers:
            sched.delete_workers()
    assert wait_until(lambda: slurm_cluster.job_ids() == [])
