"""A killed rollout worker or rollout proxy fails the rollout within 30 s at the default
health settings, and the error names what was killed.

Real processes: the local scheduler starts one rollout worker, which launches its embedded
inference server (the tiny model) and its rollout proxy; the controller supervises all
three. The trainer would see the error from ``prepare_batch``, which waits as ``wait`` does.
"""

from __future__ import annotations

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
REPORTED_WITHIN = 30.0  # seconds from the kill to the error
WAIT_AT_MOST = 45.0  # longer, so a late report shows as too late rather than as missing


@dataclasses.dataclass
class RolloutExperiment(BaseExperimentConfig):
    """The experiment config the scheduler gets: it exports the rollout's secrets (the proxy
    admin key) to the workers."""

    rollout: InferenceEngineConfig = dataclasses.field(default_factory=InferenceEngineConfig)


@pytest.fixture
def rollout(tmp_path, tiny_model_dir, monkeypatch):
    """A rollout controller over one real worker, its server and its proxy."""
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
    controller = RolloutController(config, scheduler)
    try:
        controller.initialize(1, SchedulingSpec(cpu=1, mem=4), server_args=server_args)
        controller.start_proxies(str(tiny_model_dir))
        yield controller, scheduler.worker_pids("rollout")[controller.workers[0].id]
    finally:
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


def test_a_killed_rollout_worker_is_named_not_the_server_and_proxy_it_took_down(rollout):
    controller, worker_pid = rollout
    worker = controller.workers[0]
    server_pid = _child_running(worker_pid, "areal.inference.server")
    proxy_pid = _child_running(worker_pid, "areal.proxy.server")
    # the worker leads its process group: SIGKILL to it kills the worker and the server
    # and proxy it started at once, as the OOM killer or a lost node does
    assert os.getpgid(server_pid) == os.getpgid(proxy_pid) == worker_pid
    os.killpg(worker_pid, signal.SIGKILL)
    killed = time.monotonic()

    error, reported = _reported_failure(controller)
    seconds = reported - killed
    print(f"reported {seconds:.1f} s after the kill: {error}")
    assert isinstance(error, RolloutHealthError), f"{type(error).__name__}: {error}"
    # named as soon as the scheduler sees its process gone, with the exit code
    assert str(error).startswith(f"rollout worker {worker.id} at {worker.address} exited")
    assert "its process exited with code -9" in str(error)
    assert error.target.kind == "rollout worker"
    assert seconds < REPORTED_WITHIN


def test_a_killed_rollout_proxy_is_named_with_its_worker(rollout):
    controller, worker_pid = rollout
    worker = controller.workers[0]
    proxy = controller.proxy_addrs[0].removeprefix("http://")
    os.kill(_child_running(worker_pid, "areal.proxy.server"), signal.SIGKILL)
    killed = time.monotonic()

    error, reported = _reported_failure(controller)
    seconds = reported - killed
    print(f"reported {seconds:.1f} s after the kill: {error}")
    assert isinstance(error, RolloutHealthError), f"{type(error).__name__}: {error}"
    assert f"rollout proxy {proxy} (rollout worker {worker.id}) failed" in str(error)
    assert seconds < REPORTED_WITHIN
