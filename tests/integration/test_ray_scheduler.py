"""``scheduler.type: ray`` on a real Ray cluster: a one-node cluster on loopback per module.

The module's fixture runs ``ray start --head --block`` on 127.0.0.1 (dashboard included,
state in a temp dir of its own) and at the end stops that process tree, and only it:
``ray stop`` would end every Ray cluster of this user on the machine. Ray resolves a
loopback ``--node-ip-address`` to the machine's outward address unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (a one-node cluster), which the cluster and its
controllers get so that every Ray address stays on loopback.

* The scheduler on its own (in a subprocess, a Ray driver of its own): a role's placement
  group, a server forked beside its actor worker, a role pinned to the actor's node, a
  role the cluster cannot hold (its timeout names the waiting group), a server that exits
  and an actor that dies (both fail the liveness check naming the worker), a second
  controller of the trial (refused), and teardown (no live actor, no placement group).
* A controller SIGKILLed mid-run: Ray ends its job's actors, and their servers with them.
* ``arena_grpo``'s mini twin (two servers of TP 2, an ``fsdp:d2`` actor, xccl over gloo,
  ``session_gateway``) trains two steps with ``actor.weight_sync_check``; the sentinel
  secrets of its controller appear nowhere Ray keeps or shows anything (state API:
  actors, jobs, tasks, workers, placement groups; the session's files) nor in any argv.
* The same run with a worker's Ray actor SIGKILLed mid-run fails within 60 s, naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from areal.infra.rpc.processes import descendant_pids, kill_process_trees, process_alive
from areal.infra.rpc.secret_env import is_secret_var
from areal.utils.network import find_free_ports
from tests.helpers.arena_jobs import REPO, local_arena_env

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Not installed: a skip, which fails under CI (tests/skip_policy.py); .[ray] installs it.
state = pytest.importorskip("ray.util.state", reason="needs ray (pip install -e '.[ray]')")

MINI_PROFILE = REPO / "examples" / "swe" / "arena_grpo_mini.yaml"
ONE_NODE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
NAMESPACE = "areal_arena-grpo-mini_{trial}"


@dataclass
class RayCluster:
    """A running one-node cluster: its GCS address, dashboard URL and temp dir."""

    address: str
    dashboard: str
    temp_dir: Path

    def actors(self, namespace: str) -> list[dict]:
        found = state.list_actors(
            address=self.dashboard, filters=[("ray_namespace", "=", namespace)], detail=True
        )
        return [dataclasses.asdict(actor) for actor in found]

    def placement_groups(self, prefix: str) -> list[dict]:
        found = state.list_placement_groups(address=self.dashboard, detail=True)
        return [dataclasses.asdict(pg) for pg in found if pg.name.startswith(prefix)]

    def everything_shown(self) -> str:
        """What the state API shows of every job, actor, task, worker, node and group."""
        shown = []
        for lister in (
            state.list_jobs,
            state.list_actors,
            state.list_tasks,
            state.list_workers,
            state.list_nodes,
            state.list_placement_groups,
        ):
            kwargs = {} if lister is state.list_jobs else {"detail": True}
            for item in lister(address=self.dashboard, **kwargs):
                shown.append(json.dumps(_plain(item), default=str))
        return "\n".join(shown)


def _plain(item: object) -> object:
    if dataclasses.is_dataclass(item):
        return dataclasses.asdict(item)
    if hasattr(item, "model_dump"):
        return item.model_dump()
    return item


def _public_env() -> dict[str, str]:
    prefixes = ("AREAL_", "ARENA_", "SWE_RL_", "RAY_")
    return {
        k: v for k, v in os.environ.items() if not is_secret_var(k) and not k.startswith(prefixes)
    }


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    # short: Ray's socket paths under the temp dir must fit in 107 characters
    temp_dir = Path(tempfile.mkdtemp(prefix="areal-ray-", dir="/tmp"))
    gcs, dashboard, client, agent = find_free_ports(4)
    command = [
        str(Path(sys.executable).parent / "ray"),
        *("start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}"),
        *("--num-cpus=8", f"--memory={16 * 1024**3}", f"--object-store-memory={200 * 1024**2}"),
        *(f"--temp-dir={temp_dir}", "--include-dashboard=true", "--dashboard-host=127.0.0.1"),
        *(f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}"),
        *(f"--dashboard-agent-listen-port={agent}", "--disable-usage-stats"),
    ]
    # the nodes' environment is what workers see: no secret of this process, offline hub
    env = {**_public_env(), **ONE_NODE, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(temp_dir / "ray-start.log", "w") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    cluster = RayCluster(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}", temp_dir)
    try:
        _wait_for_node(cluster, process)
        yield cluster
    finally:
        _stop(process, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop(process: subprocess.Popen, temp_dir: Path) -> None:
    """SIGTERM to ``ray start --block``, which stops its cluster in order (all at once, the
    GCS and raylet take many seconds); SIGKILL to whatever of it is left after 30 s."""
    tree = [process.pid, *descendant_pids(process.pid), *_pids_mentioning(str(temp_dir))]
    process.terminate()
    deadline = time.monotonic() + 30
    while any(process_alive(pid) for pid in tree) and time.monotonic() < deadline:
        process.poll()
        time.sleep(0.2)
    kill_process_trees([pid for pid in tree if process_alive(pid)], grace=1, popens=[process])


def _wait_for_node(cluster: RayCluster, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, (cluster.temp_dir / "ray-start.log").read_text()
        with contextlib.suppress(Exception):
            nodes = state.list_nodes(address=cluster.dashboard)
            if any(node.state == "ALIVE" for node in nodes):
                return
        time.sleep(0.5)
    raise AssertionError("the Ray cluster did not come up in time")


def _pids_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
    return found


def _all_argv() -> set[str]:
    argv = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                argv.add(Path(f"/proc/{entry}/cmdline").read_bytes().decode("utf-8", "replace"))
    return argv


def _files_containing(root: Path, needle: str) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with contextlib.suppress(OSError):
                if needle.encode() in path.read_bytes():
                    found.append(path)
    return found


# --- the scheduler on its own ---


def test_scheduler_places_forks_detects_deaths_and_removes_every_actor(ray_cluster, tmp_path):
    env = {**_public_env(), **ONE_NODE, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.test_ray_scheduler", ray_cluster.address],
        cwd=REPO,
        env={**env, "SCENARIO_ROOT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    # a CPU role is one PACK group with a bundle of its spec per worker
    [group] = report["groups"]
    assert group["strategy"] == "PACK" and group["state"] == "CREATED", group
    assert list(group["bundles"].values()) == [{"CPU": 1.0, "memory": float(1024**3)}] * 2
    # the server forked beside actor/0 runs under actor/0's worker process, on its node
    assert report["fork"]["ip"] == report["actor/0"]["ip"]
    assert report["fork"]["under_actor0"], report["fork"]
    assert report["ref"]["node_id"] == report["actor/0"]["node_id"]
    [ref] = [a for a in report["actors"] if a["name"] == "ref/0"]
    assert not ref["required_resources"] and not ref["placement_group_id"], ref
    # a role the cluster cannot hold times out naming its waiting placement group
    assert "were not up after 3s" in report["huge"], report["huge"]
    assert "placement group(s) are PENDING" in report["huge"], report["huge"]
    assert "lower the role's scheduling_spec" in report["huge"]
    # a server that exits: its worker fails with the exit code
    assert report["exited"].startswith("worker actor/1 exited with code -9"), report["exited"]
    assert "Ray actor 'actor/1'" in report["exited"]
    # an actor that dies: the worker forked beside it fails too, naming the Ray actor
    assert "Ray actor 'actor/0' in namespace 'areal_exp_trial' died" in report["died"]
    assert "ray.kill" in report["died"] or "died unexpectedly" in report["died"]
    # a second controller of the same trial is refused while the first one's actors run
    assert "another controller of trial exp/trial" in report["second"], report["second"]
    # teardown: every actor dead, every placement group removed, no server left
    assert report["after"]["actors"] and set(report["after"]["actors"]) == {"DEAD"}
    assert report["after"]["groups"] and set(report["after"]["groups"]) == {"REMOVED"}
    assert not [pid for pid in report["server_pids"] if process_alive(pid)]


def test_a_killed_controllers_actors_end_with_it(ray_cluster, tmp_path):
    """A controller SIGKILLed runs no cleanup: its Ray job ends, and Ray its actors."""
    env = {**_public_env(), **ONE_NODE, "PYTHONPATH": str(REPO), "SCENARIO_ROOT": str(tmp_path)}
    command = [sys.executable, "-m", "tests.integration.test_ray_scheduler"]
    controller = subprocess.Popen(
        [*command, ray_cluster.address, "orphan"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = controller.stdout.readline()  # the worker is up (or the controller failed)
        assert line, "the controller exited before its worker was up"
        server_pid = json.loads(line)["pid"]
        [actor] = ray_cluster.actors("areal_exp_orphan")
        assert actor["state"] == "ALIVE" and process_alive(server_pid)
    finally:
        controller.kill()
        controller.wait()

    def gone() -> bool:
        dead = ray_cluster.actors("areal_exp_orphan")[0]["state"] == "DEAD"
        return dead and not process_alive(server_pid)

    deadline = time.monotonic() + 30
    while not gone():
        assert time.monotonic() < deadline, "the worker outlived its controller by 30 s"
        time.sleep(0.2)


def _scenario(address: str, root: Path) -> dict:
    """Runs in a subprocess (a Ray driver of its own); prints what it saw as JSON."""
    from ray.util.placement_group import placement_group_table

    from areal.api.cli_args import (
        BaseExperimentConfig,
        ClusterSpecConfig,
        NameResolveConfig,
        SchedulingSpec,
        SchedulingStrategy,
    )
    from areal.api.scheduler_api import Job
    from areal.infra.rpc.processes import descendant_pids
    from areal.infra.scheduler.exceptions import SchedulerError, WorkerFailedError
    from areal.infra.scheduler.ray import RayScheduler

    def config(name: str) -> BaseExperimentConfig:
        return BaseExperimentConfig(
            experiment_name="exp",
            trial_name="trial",
            cluster=ClusterSpecConfig(
                fileroot=str(root / name / "files"),
                n_gpus_per_node=0,
                name_resolve=NameResolveConfig(nfs_record_root=str(root / name / "records")),
            ),
        )

    def failure(worker_id: str) -> str:
        try:
            scheduler._check_alive(scheduler._handle(worker_id))
        except WorkerFailedError as e:
            return str(e)
        return "still alive"

    report: dict = {}
    spec = SchedulingSpec(cpu=1, mem=1, gpu=0)
    scheduler = RayScheduler(config("first"), address=address, stop_grace=3.0)
    scheduler.create_workers(Job("actor", 2, [spec]))
    scheduler.get_workers("actor")
    report["groups"] = [placement_group_table(pg) for pg in scheduler._groups["actor"]]
    for worker_id in ("actor/0", "actor/1"):
        report[worker_id] = scheduler._info(scheduler._workers[worker_id])
    colocated = SchedulingStrategy(type="colocation", target="actor", fork=True)
    [fork_id] = scheduler.create_workers(Job("rollout", 1, [spec], colocated))
    fork = scheduler._handle(fork_id)
    [fork_worker] = scheduler.get_workers("rollout")
    under = fork.pid in descendant_pids(report["actor/0"]["pid"])
    report["fork"] = {"ip": fork_worker.ip, "pid": fork.pid, "under_actor0": under}
    # a role on the actor's node without fork (another replica count): no resources of its
    # own, pinned to the node of the actor workers it joins
    beside = SchedulingStrategy(type="colocation", target="actor", fork=False)
    scheduler.create_workers(Job("ref", 1, [spec], beside))
    scheduler.get_workers("ref")
    report["ref"] = scheduler._info(scheduler._workers["ref/0"])
    # a role the cluster cannot hold: the startup timeout says which group waits, and why
    scheduler.create_workers(Job("huge", 1, [SchedulingSpec(cpu=64, mem=1)]))
    try:
        scheduler.get_workers("huge", timeout=3)
        report["huge"] = "started"
    except SchedulerError as e:
        report["huge"] = str(e)
    scheduler.delete_workers("huge")
    report["server_pids"] = [report["actor/0"]["pid"], report["actor/1"]["pid"], fork.pid]
    report["server_pids"].append(report["ref"]["pid"])

    os.kill(report["actor/1"]["pid"], signal.SIGKILL)
    time.sleep(1.5)  # past the liveness answer's reuse time
    report["exited"] = failure("actor/1")

    try:
        RayScheduler(config("second"), address=address).create_workers(Job("actor", 2, [spec]))
        report["second"] = "started"
    except SchedulerError as e:
        report["second"] = str(e)

    import ray

    ray.kill(scheduler._workers["actor/0"].actor)
    time.sleep(1.5)
    report["died"] = failure(fork_id)

    scheduler.delete_workers()
    ray.init(address=address, ignore_reinit_error=True)  # teardown disconnected
    namespace = scheduler.namespace
    deadline = time.monotonic() + 30  # ray.kill takes effect shortly after it returns
    while True:
        actors = state.list_actors(
            address, filters=[("ray_namespace", "=", namespace)], detail=True
        )
        groups = [pg for pg in state.list_placement_groups(address) if namespace in pg.name]
        after = {"actors": [a.state for a in actors], "groups": [g.state for g in groups]}
        report["actors"] = [dataclasses.asdict(actor) for actor in actors]
        settled = set(after["actors"]) <= {"DEAD"} and set(after["groups"]) <= {"REMOVED"}
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    report["after"] = after
    return report


# --- the mini twin ---


@dataclass
class _Run:
    """A controller of the mini twin against the module's cluster."""

    env: dict[str, str]
    fileroot: Path
    secrets: tuple[str, ...]
    trial: str

    @property
    def trial_dir(self) -> Path:
        return self.fileroot / "logs" / getpass.getuser() / "arena-grpo-mini" / self.trial

    @property
    def namespace(self) -> str:
        return NAMESPACE.format(trial=self.trial)

    def start(self, output: Path, *overrides: str) -> subprocess.Popen:
        command = [
            *(sys.executable, "-m", "examples.swe.train_swe_rl"),
            *("--config", str(MINI_PROFILE)),
            *("scheduler.type=ray", f"trial_name={self.trial}", *overrides),
        ]
        with open(output, "w") as out:
            return subprocess.Popen(
                command, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )


def _mini_run(tmp_path: Path, cluster: RayCluster, model: Path, arena, trial: str) -> _Run:
    """The controller's environment: the cluster's address, the local Arena's URL and token,
    and sentinel secrets (admin key, RPC token, inference key) that must stay out of Ray."""
    base_url, arena_token = arena
    admin_key, rpc_token, inference_key = (f"sentinel-{n}-{os.urandom(8).hex()}" for n in "ari")
    fileroot = tmp_path / "fileroot"
    fileroot.mkdir()
    env = local_arena_env(
        fileroot,
        model,
        admin_key,
        AREAL_IMAGE=str(tmp_path / "unused.sif"),
        AREAL_PYTHON=sys.executable,
        AREAL_DIR=str(REPO),
        ARENA_STREAM_ID="arith-length",  # length-scored: rewards differ within a group
        RAY_ADDRESS=cluster.address,
        **ONE_NODE,
    )
    env["ARENA_OPENAPI_BASE"] = base_url  # (local_arena_env drops the caller's Arena variables)
    env["ARENA_OPENAPI_TOKEN"] = env["ARENA_LLM_API_KEY"] = arena_token
    env["AREAL_RPC_TOKEN"], env["AREAL_INFERENCE_API_KEY"] = rpc_token, inference_key
    return _Run(env, fileroot, (admin_key, rpc_token, inference_key, arena_token), trial)


class _Sampler:
    """Every process argv and the trial's actors as the state API shows them, twice a
    second while the run goes on."""

    def __init__(self, cluster: RayCluster, namespace: str):
        self.cluster, self.namespace = cluster, namespace
        self.argv: set[str] = set()
        self.actors: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.argv |= _all_argv()
            with contextlib.suppress(Exception):
                for actor in self.cluster.actors(self.namespace):
                    self.actors[actor["name"]] = actor


def test_arena_grpo_mini_twin_trains_two_steps_on_ray(
    ray_cluster, tmp_path, tiny_model_dir, local_arena
):
    run = _mini_run(tmp_path, ray_cluster, tiny_model_dir, local_arena, "train")
    output = tmp_path / "controller.out"
    with _Sampler(ray_cluster, run.namespace) as sampler:
        controller = run.start(output)
        try:
            code = controller.wait(timeout=600)
        finally:
            controller.kill()
    text = output.read_text(errors="replace")
    assert code == 0, text[-6000:]

    rows = [json.loads(x) for x in (run.trial_dir / "stats.jsonl").read_text().splitlines() if x]
    assert [row["global_step"] for row in rows] == [0, 1], text[-4000:]
    for row in rows:
        assert row["train/weight_version"] == row["global_step"] + 1
        # after this step's update, both servers against the actor (the run enforces the
        # same 1e-4, so it would have failed otherwise)
        for server in (0, 1):
            assert row[f"weight_sync/server{server}_max_abs_logp_diff"] <= 1e-4, row
        assert row["ppo_actor/n_seqs"] == 4.0  # 2 prompts x 2 samples
    assert any(row["ppo_actor/grad_norm"] > 0 for row in rows), rows

    # the workers were Ray actors with their spec's resources, each in its role's group
    workers = {"actor/0", "actor/1", "rollout/0", "rollout/1"}
    assert set(sampler.actors) == workers, sampler.actors.keys()
    for actor in sampler.actors.values():
        assert actor["class_name"] == "WorkerHost"
        assert actor["placement_group_id"], actor
        wanted = {k.split("_group_")[0] for k, v in actor["required_resources"].items() if v >= 1}
        assert wanted == {"CPU", "memory"}, actor["required_resources"]
    # the servers joined the weight-update group with 2 ranks each, as in the profile
    assert sum("--tp-size 2 " in argv.replace("\0", " ") for argv in sampler.argv) >= 2
    # shutdown removed every actor and placement group
    assert {a["state"] for a in ray_cluster.actors(run.namespace)} == {"DEAD"}
    groups = ray_cluster.placement_groups(run.namespace)
    assert len(groups) == 2 and {g["state"] for g in groups} == {"REMOVED"}, groups

    # secrets: nowhere Ray shows or keeps anything, in no argv, in no log of the run
    shown = ray_cluster.everything_shown()
    for secret in run.secrets:
        assert secret not in shown
        assert _files_containing(ray_cluster.temp_dir, secret) == []
        assert not [argv for argv in sampler.argv if secret in argv]
        assert secret not in text
        assert _files_containing(run.fileroot, secret) == []


def test_a_killed_worker_fails_the_run_within_60s_naming_it(
    ray_cluster, tmp_path, tiny_model_dir, local_arena
):
    run = _mini_run(tmp_path, ray_cluster, tiny_model_dir, local_arena, "killed")
    output = tmp_path / "controller.out"
    stats = run.trial_dir / "stats.jsonl"
    controller = run.start(
        output,
        "total_train_steps=50",  # far more than the run gets to
        "rollout.health_check_interval=1",
    )
    try:
        deadline = time.monotonic() + 300
        while controller.poll() is None and time.monotonic() < deadline:
            if stats.exists() and stats.read_text().strip():
                break  # step 0 is done; step 1's rollouts run on both workers
            time.sleep(0.2)
        assert controller.poll() is None, output.read_text()[-4000:]
        [victim] = [a for a in ray_cluster.actors(run.namespace) if a["name"] == "rollout/1"]
        assert victim["state"] == "ALIVE"
        os.kill(victim["pid"], signal.SIGKILL)  # the worker's Ray actor, as an OOM kill would
        killed = time.monotonic()
        try:
            code = controller.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("the run was still going 120 s after a worker was killed")
        elapsed = time.monotonic() - killed
    finally:
        controller.kill()
        controller.wait()

    text = output.read_text(errors="replace")
    assert code != 0, text[-4000:]
    assert elapsed < 60, f"{elapsed:.0f}s"
    # the error names the worker, and says its Ray actor died
    failure = next((line for line in text.splitlines() if "rollout worker rollout/1" in line), "")
    assert failure, text[-4000:]
    assert "the run is failed" in text, text[-4000:]
    assert "Ray actor 'rollout/1'" in text, text[-4000:]
    # and nothing of the run is left on the cluster
    deadline = time.monotonic() + 30
    while {a["state"] for a in ray_cluster.actors(run.namespace)} != {"DEAD"}:
        assert time.monotonic() < deadline, ray_cluster.actors(run.namespace)
        time.sleep(0.5)


def _orphan(address: str, root: Path) -> None:
    """Runs in a subprocess: one worker, its pids on stdout, then waits to be killed."""
    from areal.api.cli_args import (
        BaseExperimentConfig,
        ClusterSpecConfig,
        NameResolveConfig,
        SchedulingSpec,
    )
    from areal.api.scheduler_api import Job
    from areal.infra.scheduler.ray import RayScheduler

    config = BaseExperimentConfig(
        experiment_name="exp",
        trial_name="orphan",
        cluster=ClusterSpecConfig(
            fileroot=str(root / "files"),
            n_gpus_per_node=0,
            name_resolve=NameResolveConfig(nfs_record_root=str(root / "records")),
        ),
    )
    scheduler = RayScheduler(config, address=address)
    scheduler.create_workers(Job("actor", 1, [SchedulingSpec(cpu=1, mem=1)]))
    scheduler.get_workers("actor")
    print(json.dumps(scheduler._info(scheduler._workers["actor/0"])), flush=True)
    time.sleep(600)


if __name__ == "__main__":  # the scheduler scenarios' own Ray drivers (see the tests above)
    root = Path(os.environ["SCENARIO_ROOT"])
    if sys.argv[2:] == ["orphan"]:
        _orphan(sys.argv[1], root)
    else:
        print(json.dumps(_scenario(sys.argv[1], root), default=str))
