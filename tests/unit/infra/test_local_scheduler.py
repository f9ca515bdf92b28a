"""LocalScheduler end to end: real worker processes, engines, forks, teardown, secrets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from areal.api.cli_args import (
    BaseExperimentConfig,
    ClusterSpecConfig,
    NameResolveConfig,
    SchedulingSpec,
    SchedulingStrategy,
)
from areal.api.scheduler_api import RPC_TOKEN_ENV, Job
from areal.infra.rpc.processes import descendant_pids
from areal.infra.scheduler.exceptions import (
    GPUAllocationError,
    WorkerConfigurationError,
    WorkerCreationError,
    WorkerFailedError,
    WorkerNotFoundError,
)
from areal.infra.scheduler.local import LocalScheduler
from areal.utils import name_resolve
from tests.helpers.rpc_health import signed_health

REPO_ROOT = Path(__file__).resolve().parents[3]
ECHO = "tests.unit.infra.fake_engines.EchoEngine"
STARTUP = 60.0


def alive(pid: int) -> bool:
    try:
        import psutil
    except ImportError:
        from areal.infra.rpc.processes import process_alive

        return process_alive(pid)
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def make_config(root: Path) -> BaseExperimentConfig:
    return BaseExperimentConfig(
        experiment_name="exp",
        trial_name="trial",
        seed=5,
        cluster=ClusterSpecConfig(
            fileroot=str(root / "files"),
            n_gpus_per_node=2,
            name_resolve=NameResolveConfig(nfs_record_root=str(root / "name_resolve")),
        ),
    )


@pytest.fixture
def scheduler(tmp_path, monkeypatch):
    monkeypatch.delenv(RPC_TOKEN_ENV, raising=False)
    monkeypatch.chdir(REPO_ROOT)  # workers import tests.* through the controller's cwd
    sched = LocalScheduler(make_config(tmp_path), gpu_devices=[0, 1], stop_grace=5.0)
    yield sched
    sched.delete_workers()
    name_resolve.reconfigure("memory")


def create_engines(sched: LocalScheduler, worker_ids: list[str], **kwargs) -> None:
    async def create() -> None:
        await asyncio.gather(*(sched.create_engine(w, ECHO, None, **kwargs) for w in worker_ids))

    asyncio.run(create())


def test_two_roles_gpus_env_and_calls(scheduler):
    actor_spec = SchedulingSpec(
        cpu=1,
        gpu=1,
        mem=1,
        port_count=3,
        env_vars={"AREAL_TEST_ROLE": "actor", "AREAL_TEST_HOME": "${HOME}/areal"},
    )
    assert scheduler.create_workers(Job("actor", 2, [actor_spec])) == ["actor/0", "actor/1"]
    scheduler.create_workers(Job("rollout", 1, [SchedulingSpec(gpu=1, port_count=1)]))
    actors = scheduler.get_workers("actor", timeout=STARTUP)
    rollouts = scheduler.get_workers("rollout", timeout=STARTUP)
    assert [w.id for w in actors] == ["actor/0", "actor/1"]
    assert actors[0].ip == "127.0.0.1"
    assert len(actors[0].worker_ports) == 3 and actors[0].engine_ports == actors[0].worker_ports[1:]
    assert rollouts[0].engine_ports == []
    assert scheduler.n_gpus_per_node == 2

    create_engines(scheduler, ["actor/0", "actor/1", "rollout/0"])
    visible = {
        w: scheduler.call_engine(w, "get_env", "CUDA_VISIBLE_DEVICES")
        for w in ("actor/0", "actor/1", "rollout/0")
    }
    assert visible == {"actor/0": "0", "actor/1": "1", "rollout/0": "0"}  # round robin
    assert scheduler.call_engine("actor/1", "get_env", "AREAL_TEST_ROLE") == "actor"
    home = scheduler.call_engine("actor/0", "get_env", "AREAL_TEST_HOME")
    assert home == f"{os.environ['HOME']}/areal"
    assert scheduler.call_engine("rollout/0", "get_env", "AREAL_TEST_ROLE") is None
    assert str(REPO_ROOT) in scheduler.call_engine("rollout/0", "get_env", "PYTHONPATH")

    async def concurrent_calls() -> list[int]:
        return await asyncio.gather(
            *(scheduler.async_call_engine(w, "add", 2, b=3) for w in ("actor/0", "rollout/0"))
        )

    assert asyncio.run(concurrent_calls()) == [5, 5]
    asyncio.run(scheduler.set_worker_env("rollout/0", {"LATE_FLAG": "1"}))
    assert scheduler.call_engine("rollout/0", "get_env", "LATE_FLAG") == "1"
    with pytest.raises(WorkerNotFoundError):
        scheduler.call_engine("critic/0", "add", 1, 2)


def test_teardown_leaves_no_processes_and_the_token_stays_private(scheduler):
    token = scheduler.rpc_token.reveal()
    assert token and token not in os.environ.get(RPC_TOKEN_ENV, "")
    scheduler.create_workers(Job("actor", 2, [SchedulingSpec(port_count=2)]))
    scheduler.get_workers("actor", timeout=STARTUP)
    strategy = SchedulingStrategy(type="colocation", target="actor", fork=True)
    assert scheduler.create_workers(Job("ref", 2, [SchedulingSpec()], strategy)) == [
        "ref/0",
        "ref/1",
    ]
    refs = scheduler.get_workers("ref")
    assert len(refs[0].engine_ports) == 1  # as many extra ports as the target
    create_engines(scheduler, ["actor/0", "actor/1", "ref/0", "ref/1"])
    grandchild = scheduler.call_engine("ref/1", "spawn_sleeper")
    scheduler.call_engine("actor/0", "say", "hello from actor")
    scheduler.call_engine("ref/0", "say", "hello from ref")

    pids = scheduler.worker_pids()
    assert set(pids) == {"actor/0", "actor/1", "ref/0", "ref/1"}
    assert scheduler.call_engine("ref/0", "pid") == pids["ref/0"] != pids["actor/0"]
    everything = {*pids.values(), grandchild}
    for pid in pids.values():
        everything.update(descendant_pids(pid))
    assert all(alive(p) for p in everything)
    for pid in everything:
        assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    # the token does reach the workers, through their environment
    assert (
        f"{RPC_TOKEN_ENV}={token}".encode() in Path(f"/proc/{pids['ref/0']}/environ").read_bytes()
    )

    scheduler.delete_workers()
    leftovers = [p for p in everything if alive(p)]
    assert not leftovers, f"processes left after delete_workers: {leftovers}"
    logs = list(scheduler.log_dir.glob("*.log"))
    assert {p.name for p in logs} >= {"actor.log", "ref.log", "merged.log"}
    merged = (scheduler.log_dir / "merged.log").read_text()
    assert "[actor/0] hello from actor" in merged and "[ref/0] hello from ref" in merged
    for log in logs:
        assert token not in log.read_text(), log


def test_killed_worker_surfaces_as_worker_failed(scheduler):
    scheduler.create_workers(Job("rollout", 1, [SchedulingSpec(port_count=1)]))
    scheduler.get_workers("rollout", timeout=STARTUP)
    create_engines(scheduler, ["rollout/0"])
    scheduler.call_engine("rollout/0", "say", "about to be killed")
    os.kill(scheduler.worker_pids()["rollout/0"], signal.SIGKILL)
    with pytest.raises(WorkerFailedError) as info:
        scheduler.call_engine("rollout/0", "add", 1, 2, retry_delay=0.2)
    assert info.value.worker_id == "rollout/0"
    assert info.value.exit_code == -signal.SIGKILL
    assert "about to be killed" in info.value.logs
    scheduler.delete_workers("rollout")  # a dead worker is deleted without complaint


def test_role_alias_shares_the_target_process(scheduler):
    scheduler.create_workers(Job("actor", 1, [SchedulingSpec(port_count=1)]))
    strategy = SchedulingStrategy(type="colocation", target="actor", fork=False)
    assert scheduler.create_workers(Job("critic", 1, [SchedulingSpec()], strategy)) == ["critic/0"]
    critic = scheduler.get_workers("critic", timeout=STARTUP)[0]
    actor = scheduler.get_workers("actor")[0]
    assert critic.id == "critic/0" and critic.worker_ports == actor.worker_ports
    create_engines(scheduler, ["actor/0", "critic/0"])
    assert scheduler.call_engine("critic/0", "pid") == scheduler.call_engine("actor/0", "pid")
    assert scheduler.call_engine("critic/0", "echo")["name"] == "echo"
    scheduler.delete_workers("critic")
    assert scheduler.call_engine("actor/0", "add", 1, 1) == 2  # the target keeps running


def test_spec_and_role_validation(scheduler):
    with pytest.raises(WorkerCreationError, match="invalid role"):
        scheduler.create_workers(Job("a:b", 1, [SchedulingSpec()]))
    with pytest.raises(WorkerConfigurationError, match="--port"):
        scheduler.create_workers(
            Job("x", 1, [SchedulingSpec(cmd="python -m areal.infra.rpc.rpc_server --port 9")])
        )
    with pytest.raises(GPUAllocationError, match="3 GPUs"):
        scheduler.create_workers(Job("big", 1, [SchedulingSpec(gpu=3)]))
    with pytest.raises(WorkerConfigurationError, match="2 scheduling specs for 3"):
        scheduler.create_workers(Job("y", 3, [SchedulingSpec(), SchedulingSpec()]))
    with pytest.raises(WorkerNotFoundError):
        strategy = SchedulingStrategy(type="colocation", target="ghost")
        scheduler.create_workers(Job("z", 1, [SchedulingSpec()], strategy))
    scheduler.create_workers(Job("once", 1, [SchedulingSpec(port_count=1)]))
    with pytest.raises(WorkerCreationError, match="already"):
        scheduler.create_workers(Job("once", 1, [SchedulingSpec()]))


CONTROLLER = textwrap.dedent(
    """
    import json, sys, time
    from areal.api.cli_args import BaseExperimentConfig, ClusterSpecConfig, NameResolveConfig
    from areal.api.cli_args import SchedulingSpec
    from areal.api.scheduler_api import Job
    from areal.infra.scheduler.local import LocalScheduler

    root, mode = sys.argv[1], sys.argv[2]
    config = BaseExperimentConfig(
        experiment_name="exp",
        trial_name="ctl",
        cluster=ClusterSpecConfig(
            fileroot=root + "/files",
            name_resolve=NameResolveConfig(nfs_record_root=root + "/nr"),
        ),
    )
    scheduler = LocalScheduler(config)
    scheduler.create_workers(Job("actor", 2, [SchedulingSpec(port_count=1)]))
    scheduler.get_workers("actor", timeout=60)
    print(json.dumps(scheduler.worker_pids()), flush=True)
    if mode == "wait":
        time.sleep(120)
    """
)


@pytest.mark.parametrize(
    ("mode", "sig"), [("wait", signal.SIGTERM), ("wait", signal.SIGINT), ("exit", None)]
)
def test_controller_exit_kills_its_workers(tmp_path, mode, sig):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONFAULTHANDLER": "1"}
    env.pop(RPC_TOKEN_ENV, None)
    log = tmp_path / "controller.log"
    with open(log, "w") as stderr:
        controller = subprocess.Popen(
            [sys.executable, "-c", CONTROLLER, str(tmp_path), mode],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        pids = json.loads(controller.stdout.readline())
        assert len(pids) == 2 and all(alive(p) for p in pids.values())
        if sig is not None:
            controller.send_signal(sig)
        try:
            controller.wait(timeout=60)
        except subprocess.TimeoutExpired:
            # where it hangs: every thread's stack (faulthandler on SIGABRT), in its log
            controller.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                controller.wait(timeout=10)
            pytest.fail(
                f"the controller did not exit within 60 s of {sig!r}:\n"
                + log.read_text(errors="replace")[-6000:]
            )
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids.values() if alive(p)]
    finally:
        controller.kill()
        controller.wait()


@pytest.mark.parametrize(
    ("replicas", "expected"),
    [
        # one TP server over both actors: beside actor/0, seeing both GPUs
        (1, {"rollout/0": ("actor/0", "0,1")}),
        # one per actor worker (the old fork), each seeing its parent's GPU only
        (2, {"rollout/0": ("actor/0", "0"), "rollout/1": ("actor/1", "1")}),
    ],
)
def test_forked_server_spans_a_group_of_target_workers(scheduler, replicas, expected):
    actor_spec = SchedulingSpec(cpu=1, gpu=1, mem=1, port_count=2)
    scheduler.create_workers(Job("actor", 2, [actor_spec]))
    actors = {w.id: w for w in scheduler.get_workers("actor", timeout=STARTUP)}
    assert {w: signed_health(scheduler, a)["visible_devices"] for w, a in actors.items()} == {
        "actor/0": "0",
        "actor/1": "1",
    }

    fork = SchedulingStrategy(type="colocation", target="actor", fork=True)
    job = Job("rollout", replicas, [SchedulingSpec(gpu=1, port_count=1)], fork)
    assert scheduler.create_workers(job) == sorted(expected)
    rollouts = {w.id: w for w in scheduler.get_workers("rollout")}
    assert sorted(rollouts) == sorted(expected)
    assert all(len(w.engine_ports) == 1 for w in rollouts.values())  # as many as the target

    pids = scheduler.worker_pids()
    assert set(pids) == {"actor/0", "actor/1", *expected}  # forked: no new started process
    for wid, (parent, devices) in expected.items():
        assert pids[wid] in descendant_pids(pids[parent]), f"{wid} not forked by {parent}"
        assert rollouts[wid].ip == actors[parent].ip
        assert signed_health(scheduler, rollouts[wid])["visible_devices"] == devices
    children = {w: signed_health(scheduler, a)["forked_children"] for w, a in actors.items()}
    parents = [parent for parent, _ in expected.values()]
    assert children == {w: parents.count(w) for w in actors}

    # the engine in the forked worker sees the same devices; the parents are unchanged
    create_engines(scheduler, [*actors, *rollouts])
    for wid, (_, devices) in expected.items():
        assert scheduler.call_engine(wid, "get_env", "CUDA_VISIBLE_DEVICES") == devices
    assert scheduler.call_engine("actor/1", "get_env", "CUDA_VISIBLE_DEVICES") == "1"

    # an unsigned liveness probe learns nothing about the devices
    first = rollouts["rollout/0"]
    unsigned = httpx.get(f"http://{first.ip}:{first.worker_ports[0]}/health", timeout=5)
    assert unsigned.status_code == 200 and unsigned.json() == {"status": "healthy"}

    # deleting the target takes its forked dependents along
    forked_pids = [pids[w] for w in expected]
    scheduler.delete_workers("actor")
    assert not [p for p in forked_pids if alive(p)]
    assert scheduler.worker_pids() == {}


def test_fork_with_a_replica_count_that_does_not_divide_starts_new_processes(scheduler):
    # 3 actor workers on GPUs 0,1 round robin: 0, 1, 0
    scheduler.create_workers(Job("actor", 3, [SchedulingSpec(gpu=1, port_count=1)]))
    scheduler.get_workers("actor", timeout=STARTUP)
    fork = SchedulingStrategy(type="colocation", target="actor", fork=True)
    job = Job("rollout", 2, [SchedulingSpec(gpu=1, port_count=1)], fork)
    assert scheduler.create_workers(job) == ["rollout/0", "rollout/1"]
    rollouts = scheduler.get_workers("rollout", timeout=STARTUP)

    # not forked: two processes of their own (children of this controller, of no actor),
    # each on every device of the target and on no new one
    pids = scheduler.worker_pids()
    actor_trees = {p for w in ("actor/0", "actor/1", "actor/2") for p in descendant_pids(pids[w])}
    for wid in ("rollout/0", "rollout/1"):
        assert pids[wid] not in actor_trees
        assert pids[wid] in descendant_pids(os.getpid())
    for w in rollouts:
        health = signed_health(scheduler, w)
        assert health["visible_devices"] == "0,1" and health["forked_children"] == 0
    actors = scheduler.get_workers("actor")
    assert [signed_health(scheduler, a)["forked_children"] for a in actors] == [0, 0, 0]
