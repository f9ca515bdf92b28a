"""A killed rollout worker or rollout proxy fails the rollout within 30 s at the default
health settings, and the error names what was killed.

Real processes: the local scheduler starts two rollout workers for two controllers (the
training and the evaluation rollout), each launching its embedded inference server (the
tiny model) and its rollout proxy; each controller supervises its three. One worker is
killed with its children, the other worker's proxy alone, at once. The trainer would see
the errors from ``prepare_batch``, which waits as ``wait`` does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from areal.api.cli_args import (
    BaseExperimentConfig,
    ClusterSpecConfig,
    InferenceEngineConfig,
    NameResolveConfig,
    SchedulingSpec,
    SGLangConfig,
)
from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.engine.sglang_backend import HFBackend
from areal.infra.controller.health import RolloutHealthError
from areal.infra.controller.rollout_controller import RolloutController
from areal.infra.rpc.processes import descendant_pids
from areal.infra.scheduler.local import LocalScheduler
from areal.utils import name_resolve

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
ROLES = ("rollout", "eval-rollout")
REPORTED_WITHIN = 30.0  # seconds from the kill to the error
WAIT_AT_MOST = 45.0  # longer, so a late report shows as too late rather than as missing


@dataclasses.dataclass
class RolloutExperiment(BaseExperimentConfig):
    """The experiment config the scheduler gets: it exports the rollout's secrets (the proxy
    admin key) to the workers."""

    rollout: InferenceEngineConfig = dataclasses.field(default_factory=InferenceEngineConfig)


@pytest.fixture
def rollouts(tmp_path, tiny_model_dir, monkeypatch):
    """Two rollout controllers (roles ``rollout`` and ``eval-rollout``), each over one real
    worker, its server and its proxy, started side by side; ``{role: (controller, pid)}``."""
    monkeypatch.delenv(RPC_TOKEN_ENV, raising=False)
    monkeypatch.chdir(REPO_ROOT)
    files = tmp_path / "files"
    config = InferenceEngineConfig(
        backend="hf:d1",
        experiment_name="faults",
        trial_name="kill",
        fileroot=str(files),
        consumer_batch_size=1,
        setup_timeout=120,
    )
    config.agent.admin_api_key = "test-proxy-admin-key"  # a proxy needs one
    experiment = RolloutExperiment(
        experiment_name="faults",
        trial_name="kill",
        cluster=ClusterSpecConfig(
            fileroot=str(files),
            name_resolve=NameResolveConfig(nfs_record_root=str(tmp_path / "name_resolve")),
        ),
        rollout=config,
    )
    scheduler = LocalScheduler(experiment, gpu_devices=[], stop_grace=5.0)
    defaults = (config.health_check_interval, config.health_check_timeout)
    assert (*defaults, config.health_check_failures) == (5.0, 5.0, 3)
    server_args = HFBackend().server_args(
        SGLangConfig(model_path=str(tiny_model_dir), dtype="float32", context_length=512),
        host="",
        port=0,
    )
    del server_args["host"], server_args["port"]  # chosen by the worker
    controllers = {role: RolloutController(config, scheduler, role=role) for role in ROLES}

    def start(controller: RolloutController) -> None:
        controller.initialize(1, SchedulingSpec(cpu=1, mem=4), server_args=server_args)
        controller.start_proxies(str(tiny_model_dir))

    try:
        with concurrent.futures.ThreadPoolExecutor(len(ROLES)) as pool:
            list(pool.map(start, controllers.values()))
        yield {
            role: (c, scheduler.worker_pids(role)[c.workers[0].id])
            for role, c in controllers.items()
        }
    finally:
        for controller in controllers.values():
            controller.destroy()
        scheduler.delete_workers()
        name_resolve.reconfigure("memory")


def _reported_failure(controller: RolloutController) -> tuple[Exception, float]:
    """The error the trainer's wait for rollouts raises, and when."""
    try:
        controller.wait(1, timeout=WAIT_AT_MOST)
    except Exception as e:
        return e, time.monotonic()
    raise AssertionError("wait() returned a rollout that was never submitted")


def _child_running(worker_pid: int, module: str) -> int:
    """The pid of the worker's child that runs ``python -m module``."""
    for pid in descendant_pids(worker_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() in argv:
            return pid
    raise AssertionError(f"rollout worker {worker_pid} runs no {module}")


def test_a_killed_worker_and_a_killed_proxy_are_each_named_within_30_s(rollouts):
    # rollout/0 loses its whole process group (the worker and the server and proxy it
    # started), as the OOM killer or a lost node does; eval-rollout/0 loses its proxy alone
    controller, worker_pid = rollouts["rollout"]
    worker = controller.workers[0]
    server_pid = _child_running(worker_pid, "areal.inference.server")
    proxy_pid = _child_running(worker_pid, "areal.proxy.server")
    assert os.getpgid(server_pid) == os.getpgid(proxy_pid) == worker_pid
    eval_controller, eval_pid = rollouts["eval-rollout"]
    eval_worker = eval_controller.workers[0]
    eval_proxy = eval_controller.proxy_addrs[0].removeprefix("http://")

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waits = [pool.submit(_reported_failure, c) for c in (controller, eval_controller)]
        os.killpg(worker_pid, signal.SIGKILL)
        os.kill(_child_running(eval_pid, "areal.proxy.server"), signal.SIGKILL)
        killed = time.monotonic()
        (error, reported), (proxy_error, proxy_reported) = [w.result() for w in waits]

    for what, e, at in (("worker", error, reported), ("proxy", proxy_error, proxy_reported)):
        print(f"{what}: reported {at - killed:.1f} s after the kill: {e}")
        assert isinstance(e, RolloutHealthError), f"{type(e).__name__}: {e}"
        assert at - killed < REPORTED_WITHIN
    # the worker, named as soon as the scheduler sees its process gone, with the exit code
    # (not the server or proxy it took down)
    assert str(error).startswith(f"rollout worker {worker.id} at {worker.address} exited")
    assert "its process exited with code -9" in str(error)
    assert error.target.kind == "rollout worker"
    # the proxy, through the health supervision, with the worker it belongs to
    assert str(proxy_error).startswith(
        f"rollout proxy {eval_proxy} (rollout worker {eval_worker.id}) failed"
    )
