"""The Ray scheduler without a cluster: placement plans, the address rules and refusals,
and how a host actor starts its worker (secrets by file path only).

``WorkerHost`` is a plain class until the scheduler wraps it with ``ray.remote``, so its
command, environment and a real worker start are tested here in-process; everything that
needs Ray itself runs in tests/integration/test_ray_scheduler.py.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from areal.api.cli_args import (
    BaseExperimentConfig,
    ClusterSpecConfig,
    NameResolveConfig,
    SchedulingSpec,
)
from areal.api.config.scheduling import RPC_SERVER_CMD
from areal.api.scheduler_api import RPC_TOKEN_ENV, Worker
from areal.infra.rpc.processes import process_alive
from areal.infra.rpc.secret_env import SECRETS_FILE_ENV, secrets_file_text
from areal.infra.scheduler.exceptions import SchedulerError, WorkerConfigurationError
from areal.infra.scheduler.ray import RayScheduler, _check_reachable, _split_env_vars
from areal.infra.scheduler.ray_actors import WorkerHost, WorkerLaunch
from areal.infra.scheduler.ray_placement import (
    GIB,
    RayBlock,
    plan_placement,
    ray_address,
    ray_namespace,
    worker_resources,
)
from areal.utils import name_resolve, names
from areal.utils.network import find_free_port
from areal.utils.secrets import SecretStr
from tests.helpers.rpc_health import signed_health
from tests.unit.api.test_support import build

REPO_ROOT = Path(__file__).resolve().parents[3]


# --- placement ---


def test_a_worker_bundle_is_its_spec():
    assert worker_resources(SchedulingSpec(cpu=8, gpu=1, mem=32)) == {
        "CPU": 8.0,
        "GPU": 1.0,
        "memory": 32.0 * GIB,  # mem is GB per worker, as Slurm's mem x 1024 MB
    }
    # no CPU asked: one, as on Slurm; no GPU or memory asked: none in the bundle
    assert worker_resources(SchedulingSpec(cpu=0, gpu=0, mem=0)) == {"CPU": 1.0}


def test_a_cpu_role_is_one_pack_group():
    plan = plan_placement(SchedulingSpec(cpu=1, gpu=0, mem=2), 4, 8, "rollout")
    assert plan.blocks == (RayBlock(0, 4, "PACK"),)
    assert plan.bundle == {"CPU": 1.0, "memory": 2.0 * GIB}
    assert [plan.block_of(i) for i in range(4)] == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_gpu_roles_fill_nodes_block_by_block():
    # 16 workers x 1 GPU on 8-GPU nodes: ceil(16 / 8) = 2 nodes, workers 0-7 and 8-15
    plan = plan_placement(SchedulingSpec(cpu=8, gpu=1, mem=32), 16, 8, "actor")
    assert plan.blocks == (RayBlock(0, 8, "STRICT_PACK"), RayBlock(8, 8, "STRICT_PACK"))
    assert plan.block_of(7) == (0, 7) and plan.block_of(8) == (1, 0)
    # a TP-2 server forked beside actor workers 6 and 7 sees devices of one host
    assert plan.block_of(6)[0] == plan.block_of(7)[0]
    # 2 servers x 2 GPUs: ceil(4 / 8) = 1 node holding both
    plan = plan_placement(SchedulingSpec(gpu=2), 2, 8, "rollout")
    assert plan.blocks == (RayBlock(0, 2, "STRICT_PACK"),)
    # 4 workers x 4 GPUs on 8-GPU nodes: 2 nodes of 2 workers
    plan = plan_placement(SchedulingSpec(gpu=4), 4, 8, "actor")
    assert [(b.first, b.size) for b in plan.blocks] == [(0, 2), (2, 2)]


def test_gpu_layouts_that_cannot_be_placed_are_refused():
    with pytest.raises(WorkerConfigurationError, match=r"cluster\.n_gpus_per_node is 0"):
        plan_placement(SchedulingSpec(gpu=1), 2, 0, "actor")
    with pytest.raises(WorkerConfigurationError, match="cannot span nodes"):
        plan_placement(SchedulingSpec(gpu=16), 1, 8, "actor")
    # 3 workers x 4 GPUs need ceil(12 / 8) = 2 nodes, and 3 does not split over 2
    with pytest.raises(WorkerConfigurationError, match="divisible by 2"):
        plan_placement(SchedulingSpec(gpu=4), 3, 8, "actor")


def test_a_trials_actors_have_a_namespace_of_their_own():
    assert ray_namespace("arena-grpo", "smoke") == "areal_arena-grpo_smoke"


# --- the address: a running cluster, never a new one ---


def test_the_config_field_wins_over_the_environment():
    env = {"RAY_ADDRESS": "10.0.0.2:6379"}
    assert ray_address("10.0.0.1:6379", env) == ("10.0.0.1:6379", "scheduler.ray_address")
    assert ray_address(None, env) == ("10.0.0.2:6379", "$RAY_ADDRESS")
    assert ray_address("  ", {"RAY_ADDRESS": " auto "}) == ("auto", "$RAY_ADDRESS")


def test_no_address_and_local_are_refused():
    with pytest.raises(SchedulerError, match=r"scheduler.ray_address or \$RAY_ADDRESS"):
        ray_address(None, {})
    with pytest.raises(SchedulerError, match="would start a new Ray cluster"):
        ray_address("local", {})
    with pytest.raises(SchedulerError, match=r"\$RAY_ADDRESS is 'local'"):
        ray_address(None, {"RAY_ADDRESS": "local"})


def test_the_scheduler_refuses_before_touching_ray(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(SchedulerError, match="never starts one"):
        RayScheduler(_config(tmp_path))
    # ray missing: the install hint, and nothing was claimed or started
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(SchedulerError, match=r"pip install 'areal-arena\[ray\]'"):
        RayScheduler(_config(tmp_path), address="127.0.0.1:6379")
    assert not (tmp_path / "records").exists()


def test_an_unreachable_address_fails_at_once():
    port = find_free_port()
    began = time.monotonic()
    with pytest.raises(SchedulerError, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
        _check_reachable(f"127.0.0.1:{port}", "$RAY_ADDRESS")
    assert time.monotonic() - began < 5
    with pytest.raises(SchedulerError, match="is not a Ray address"):
        _check_reachable("head-node", "scheduler.ray_address")
    _check_reachable("auto", "scheduler.ray_address")  # left to Ray


def test_ray_configs_without_a_cluster_are_refused_at_load(monkeypatch):
    from areal.api.config.support import unsupported

    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def problems(changes: dict) -> list[tuple[str, str]]:
        return [(e.field, e.message) for e in unsupported(build(changes))]

    [(field, message)] = problems({"scheduler.type": "ray"})
    assert field == "scheduler.ray_address" and "never starts one" in message
    [(field, message)] = problems({"scheduler.type": "ray", "scheduler.ray_address": "local"})
    assert field == "scheduler.ray_address" and "would start a new Ray cluster" in message
    assert problems({"scheduler.type": "ray", "scheduler.ray_address": "10.0.0.1:6379"}) == []
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert problems({"scheduler.type": "ray"}) == []
    [(field, message)] = problems({"scheduler.type": "ray", "cluster.name_resolve.type": "etcd3"})
    assert field == "cluster.name_resolve.type" and "every Ray node shares" in message
    assert problems({"scheduler.type": "local", "cluster.name_resolve.type": "etcd3"}) == []


# --- the worker's environment: secrets by file path only ---


def test_secret_env_vars_of_a_spec_go_to_the_secrets_file():
    spec = SchedulingSpec(env_vars={"PLAIN": "$HOME/x", "KEY": SecretStr("sentinel-env-secret")})
    plain, secret = _split_env_vars(spec, "rollout")
    assert plain == {"PLAIN": "$HOME/x"}
    assert secret == {"KEY": "sentinel-env-secret"}
    with pytest.raises(WorkerConfigurationError, match="not a valid variable name"):
        _split_env_vars(SchedulingSpec(env_vars={"A-B": "1"}), "rollout")


def _launch(tmp_path: Path, **changes) -> WorkerLaunch:
    fields = {
        "worker_id": "actor/0",
        "role": "actor",
        "cmd": ("python", "-m", "areal.infra.rpc.rpc_server", "--role", "actor"),
        "python_path": str(REPO_ROOT),
        "log_dir": str(tmp_path / "logs"),
        "secrets_file": str(tmp_path / ".secrets" / "actor.0.env"),
        "host": "127.0.0.1",
    }
    return WorkerLaunch(**{**fields, **changes})


def test_the_host_builds_the_command_on_its_node(tmp_path):
    host = WorkerHost.__new__(WorkerHost)  # the methods only, no process
    host.launch, host.node_ip = _launch(tmp_path), "10.0.0.7"
    assert host.command() == [
        sys.executable,  # the node's interpreter, for a `python ...` command
        *("-m", "areal.infra.rpc.rpc_server", "--role", "actor"),
        *("--host", "10.0.0.7", "--port", "0"),
    ]
    host.launch = _launch(tmp_path, cmd=("/opt/bin/serve", "--host=0.0.0.0"))
    assert host.command() == ["/opt/bin/serve", "--host=0.0.0.0", "--port", "0"]


def test_the_host_environment_has_the_secrets_path_not_the_secrets(tmp_path, monkeypatch):
    # a node whose own environment holds secrets passes none of them on
    monkeypatch.setenv("ARENA_OPENAPI_TOKEN", "sentinel-node-token")
    monkeypatch.setenv(RPC_TOKEN_ENV, "sentinel-node-rpc")
    monkeypatch.setenv("AREAL_SECRET_ROLLOUT_KEY", "sentinel-node-key")
    monkeypatch.setenv("NODE_DIR", "/data")
    host = WorkerHost.__new__(WorkerHost)
    host.launch = _launch(
        tmp_path, env_vars={"CACHE": "$NODE_DIR/cache", "LIT": "$$x"}, visible_devices="2,3"
    )
    env = host.environment()
    assert not [v for v in env.values() if "sentinel-" in v]
    assert env[SECRETS_FILE_ENV] == str(tmp_path / ".secrets" / "actor.0.env")
    assert env["CACHE"] == "/data/cache"  # $NAME expands on the node
    assert env["LIT"] == "$x"  # $$ is a literal $
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["PYTHONPATH"] == str(REPO_ROOT)


def _config(root: Path) -> BaseExperimentConfig:
    return BaseExperimentConfig(
        experiment_name="exp",
        trial_name="trial",
        cluster=ClusterSpecConfig(
            fileroot=str(root / "files"),
            n_gpus_per_node=0,
            name_resolve=NameResolveConfig(nfs_record_root=str(root / "records")),
        ),
    )


def test_a_host_starts_a_real_worker_that_reads_and_removes_its_secrets_file(tmp_path, monkeypatch):
    """The worker proves it holds the token (its signed /health verifies), the file is gone
    once read, and the token is in no argv and not in the environment it was started with."""
    monkeypatch.delenv(RPC_TOKEN_ENV, raising=False)
    token = "sentinel-rpc-" + os.urandom(8).hex()
    records = tmp_path / "records"
    secrets_dir = tmp_path / ".secrets"
    secrets_dir.mkdir(mode=0o700)
    secrets_file = secrets_dir / "actor.0.env"
    fd = os.open(secrets_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets_file_text({RPC_TOKEN_ENV: token}))
    flags = [
        *("--experiment-name", "exp", "--trial-name", "trial", "--role", "actor"),
        *("--worker-index", "0", "--name-resolve-type", "nfs"),
        *("--nfs-record-root", str(records), "--fileroot", str(tmp_path / "files")),
    ]
    launch = _launch(
        tmp_path, cmd=(*RPC_SERVER_CMD.split(), *flags), secrets_file=str(secrets_file)
    )
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(records)))
    host = WorkerHost(launch)
    try:
        key = names.worker("exp", "trial", "actor", 0)
        deadline = time.monotonic() + 60
        while True:
            assert host.poll() is None, host.tail()
            try:
                address = name_resolve.get(key)
                break
            except name_resolve.NameEntryNotFoundError:
                assert time.monotonic() < deadline, host.tail()
                time.sleep(0.2)
        ip, port = address.rsplit(":", 1)

        controller = SimpleNamespace(rpc_token=SecretStr(token))
        assert signed_health(controller, Worker("actor/0", ip, [port]))["status"] == "healthy"
        assert not secrets_file.exists()
        pid = host.info()["pid"]
        assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert token.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
        assert host.info()["ip"] == "127.0.0.1"
    finally:
        code = host.stop(grace=5.0)
        name_resolve.reconfigure("memory")
    assert code is not None and not process_alive(pid)
