"""One staleness gate per run, the rollout controller's; workers and evaluation have none.

capacity = min(max_concurrent - running, (eta + v + 1) * B - (accepted + running)), and
with no staleness bound (``max_staleness=None``) only ``max_concurrent - running``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from areal.api.cli_args import InferenceEngineConfig, SchedulingSpec
from areal.api.config.fields import FieldError
from areal.api.scheduler_api import Job, Worker
from areal.api.workflow_api import RolloutWorkflow
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.infra.controller.rollout_controller import RolloutController
from areal.infra.staleness_manager import StalenessManager
from areal.infra.workflow_executor import WorkflowExecutor
from areal.trainer import evaluation
from tests.unit.infra.fake_scheduler import SyncEngineCalls

# --- the gate itself ----------------------------------------------------------------------------


def test_no_staleness_bound_leaves_only_the_concurrency_limit():
    m = StalenessManager(lambda: 0, 3, 2, max_staleness=None)
    for _ in range(10):  # 10 accepted at version 0: eta = 0 would allow (0 + 0 + 1) * 2 = 2
        m.on_enqueue()
        m.on_submit()
        m.on_accept()
    assert m.get_capacity() == 3  # 3 - 0 running; no bound on accepted
    m.on_enqueue()
    m.on_submit()
    assert m.get_capacity() == 2  # 3 - 1 running
    assert m.pending_limit is None


def test_the_gate_from_a_config():
    config = InferenceEngineConfig(
        consumer_batch_size=4, max_concurrent_rollouts=6, max_head_offpolicyness=1
    )
    m = StalenessManager.from_config(config, lambda: 2)
    assert (m.max_concurrent, m.consumer_batch_size, m.max_staleness) == (6, 4, 1)
    assert m.get_capacity() == 6  # min(6 - 0, (1 + 2 + 1) * 4 - 0 = 16)
    unbounded = InferenceEngineConfig(consumer_batch_size=4, max_head_offpolicyness=None)
    m = StalenessManager.from_config(unbounded, lambda: 0)
    assert m.max_staleness is None and m.max_concurrent == 4  # null concurrency: B


def test_the_config_takes_null_and_refuses_negative_bounds():
    assert InferenceEngineConfig(max_head_offpolicyness=None).max_head_offpolicyness is None
    with pytest.raises(FieldError, match="max_head_offpolicyness"):
        InferenceEngineConfig(max_head_offpolicyness=-1)


# --- a worker's executor has no gate ------------------------------------------------------------


class FakeEngine:
    def get_version(self) -> int:
        return 0


class AllAtOnce(RolloutWorkflow):
    """Finishes only once ``n`` rollouts run at the same time (or times out)."""

    def __init__(self, n: int):
        self.n = n
        self.running = 0
        self.lock = threading.Lock()

    async def arun_episode(self, engine: Any, data: Any) -> Any:
        with self.lock:
            self.running += 1
        deadline = time.monotonic() + 5
        while self.running < self.n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.running} of {self.n} rollouts ran at once")
            await asyncio.sleep(0.01)
        return {"row": data}


def test_an_executor_without_a_gate_starts_every_rollout_it_is_sent():
    # a gate from this config would run one rollout at a time, and accept only one at v0
    config = InferenceEngineConfig(
        consumer_batch_size=1, max_concurrent_rollouts=1, max_head_offpolicyness=0
    )
    executor = WorkflowExecutor(config, FakeEngine())
    assert executor.staleness is None and executor.get_capacity() is None
    executor.initialize()
    try:
        workflow = AllAtOnce(6)
        ids = [executor.submit(row, workflow) for row in range(6)]
        results = [executor.wait_for_task(task_id, timeout=10) for task_id in ids]
        assert [r["row"] for r in results] == list(range(6))
    finally:
        executor.destroy()


def test_a_worker_engine_has_no_gate_and_an_in_process_one_takes_its_own():
    config = InferenceEngineConfig(backend="hf:d1")
    worker = RemoteSGLangEngine(config)  # as the rollout controller's workers build it
    gate = StalenessManager(lambda: 0, 2, 1, max_staleness=None)
    in_process = RemoteSGLangEngine(config, staleness=gate)
    try:
        for engine in (worker, in_process):
            engine.runner.start(engine)  # the executor, without connecting to servers
        assert worker.workflow_executor.staleness is None
        assert in_process.workflow_executor.staleness is gate
    finally:
        worker.destroy()
        in_process.destroy()


# --- the controller holds the gate; evaluation has no bound -------------------------------------


class RecordingScheduler(SyncEngineCalls):
    """Rollout workers that take tasks and finish each at once; records the engines' configs
    and the task ids submitted."""

    rpc_token = "fake-token-123456"

    def __init__(self) -> None:
        self.engine_configs: list[InferenceEngineConfig] = []
        self.finished: dict[str, list[int]] = {}  # worker id -> task ids
        self.lock = threading.Lock()

    def create_workers(self, job: Job) -> list[str]:
        return [f"{job.role}/{i}" for i in range(job.replicas)]

    def get_workers(self, role: str, timeout: float | None = None) -> list[Worker]:
        return [Worker(f"{role}/0", "127.0.0.1", ["1"])]

    async def create_engine(self, worker_id: str, engine: str, *args: Any, **kwargs: Any) -> str:
        self.engine_configs.append(args[-1])
        return worker_id

    def delete_workers(self, role: str | None = None) -> None:
        pass

    def call_engine(self, worker_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "launch_local_server":
            return "127.0.0.1:1"
        if method == "submit":
            with self.lock:
                self.finished.setdefault(worker_id, []).append(kwargs["task_id"])
            return kwargs["task_id"]
        if method == "collect_finished":
            time.sleep(0.02)
            with self.lock:
                done = self.finished.pop(worker_id, [])
            return [(t, {"task": t}) for t in done]
        if method == "export_stats":
            return {}
        return None


def _config(**overrides: Any) -> InferenceEngineConfig:
    settings: dict[str, Any] = {
        "backend": "hf:d1",
        "consumer_batch_size": 2,
        "max_concurrent_rollouts": 2,
        "max_head_offpolicyness": 0,
        "health_check_interval": 0,  # the fake server address never answers
    }
    return InferenceEngineConfig(**{**settings, **overrides})


def test_workers_get_the_run_config_and_the_controller_gates():
    scheduler = RecordingScheduler()
    config = _config()
    controller = RolloutController(config, scheduler)
    controller.initialize(1, SchedulingSpec(), server_args={})
    try:
        (sent,) = scheduler.engine_configs
        assert sent is config  # no capacities overridden to switch a worker gate off
        assert controller.staleness.max_staleness == 0
        assert controller.staleness.max_concurrent == 2
    finally:
        controller.destroy()


def test_the_eval_controller_has_no_staleness_bound():
    scheduler = RecordingScheduler()
    rollout = RolloutController(_config(), scheduler)
    rollout.initialize(1, SchedulingSpec(), server_args={})
    eval_rollout = evaluation.start_eval_rollout(rollout, scheduler, SchedulingSpec())
    try:
        assert eval_rollout.config.max_head_offpolicyness is None
        assert eval_rollout.staleness.max_staleness is None
        # 7 rows at version 0, 2 per batch: a bound of 0 would stop after 2 accepted
        results = eval_rollout.rollout_batch(list(range(7)), "w", timeout=10)
        assert all(r is not None for r in results) and len(results) == 7
    finally:
        eval_rollout.destroy()
        rollout.destroy()
