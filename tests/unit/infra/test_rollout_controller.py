"""RolloutController against a fake scheduler: slow tasks and broken workers."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from areal.api.cli_args import InferenceEngineConfig, SchedulingSpec
from areal.api.scheduler_api import Job, Worker
from areal.infra.controller import rollout_controller
from areal.infra.controller.rollout_controller import RolloutController
from tests.unit.infra.fake_rollout import with_dispatch_thread
from tests.unit.infra.fake_scheduler import SyncEngineCalls


class FakeScheduler(SyncEngineCalls):
    """One rollout worker whose tasks finish ``task_seconds`` after submission."""

    rpc_token = "fake-token-123456"

    def __init__(
        self, task_seconds: float = 0.0, fail_submit: bool = False, reject_all: bool = False
    ):
        self.task_seconds = task_seconds
        self.fail_submit = fail_submit
        self.reject_all = reject_all
        self.submitted: list[int] = []
        self.submit_attempts = 0
        self.started: dict[int, float] = {}
        self.lock = threading.Lock()

    def create_workers(self, job: Job) -> list[str]:
        return [f"{job.role}/{i}" for i in range(job.replicas)]

    def get_workers(self, role: str, timeout: float | None = None) -> list[Worker]:
        return [Worker(f"{role}/0", "127.0.0.1", ["1"])]

    async def create_engine(self, worker_id: str, engine: str, *args: Any, **kwargs: Any) -> str:
        return worker_id

    def delete_workers(self, role: str | None = None) -> None:
        pass

    def call_engine(self, worker_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("engine_name", None)
        if method == "launch_local_server":
            return "127.0.0.1:1"
        if method == "submit":
            with self.lock:
                self.submit_attempts += 1
            if self.fail_submit:
                raise ConnectionError("worker gone")
            with self.lock:
                self.submitted.append(kwargs["task_id"])
                self.started[kwargs["task_id"]] = time.monotonic()
            return kwargs["task_id"]
        if method == "collect_finished":
            (ack,) = args
            deadline = time.monotonic() + kwargs.get("timeout", 1.0)
            while True:
                with self.lock:
                    for task_id in ack:
                        self.started.pop(task_id, None)
                    ack = []
                    now = time.monotonic()
                    done = [
                        t for t, began in self.started.items() if now - began >= self.task_seconds
                    ]
                    if done or now >= deadline:
                        return [(t, None if self.reject_all else {"task": t}) for t in done]
                time.sleep(0.01)
        if method == "export_stats":
            return {}
        return None


def _controller(scheduler: FakeScheduler, **overrides: Any) -> RolloutController:
    settings = {
        "backend": "hf:d1",
        "experiment_name": "exp",
        "trial_name": "trial",
        "consumer_batch_size": 2,
        "max_head_offpolicyness": 0,
        "max_concurrent_rollouts": 2,
        "health_check_interval": 0,  # the fake server address never answers a health check
    }
    config = InferenceEngineConfig(**{**settings, **overrides})
    controller = RolloutController(config, scheduler)
    controller.initialize(1, SchedulingSpec(), server_args={})
    return controller


def test_a_task_still_running_when_polled_is_not_rejected(monkeypatch):
    # short long-polls: the fetcher asks many times while the tasks still run
    monkeypatch.setattr(rollout_controller, "COLLECT_TIMEOUT", 0.1)
    scheduler = FakeScheduler(task_seconds=1.5)
    controller = _controller(scheduler)
    try:
        rows = [[{"id": 0}, {"id": 1}], [{"id": 2}, {"id": 3}]]
        batch = controller.prepare_batch(rows, workflow="w", batch_size=2)
        assert [t["task"] for t in batch] == [0, 1]
        # No task was rejected while it ran (that would have freed a slot for a fresh row).
        # Both accepted and none running fill the bound of (0 + 0 + 1) x 2 rollouts at
        # version 0: no capacity is left, so no other row can be dispatched later either.
        stats = controller.staleness.get_stats()
        assert (stats.accepted, stats.rejected, stats.running) == (2, 0, 0)
        assert controller.staleness.get_capacity() == 0
        assert scheduler.submitted == [0, 1]
    finally:
        controller.destroy()


def test_a_worker_that_cannot_take_tasks_stops_the_dispatch():
    scheduler = FakeScheduler(fail_submit=True)
    controller, dispatcher = with_dispatch_thread(lambda: _controller(scheduler))
    try:
        rows = [[{"id": i}, {"id": i + 1}] for i in range(0, 100, 2)]
        with pytest.raises(RuntimeError, match="rollout dispatch stopped: worker gone"):
            controller.prepare_batch(rows, workflow="w", batch_size=2)
        dispatcher.join(timeout=10)
        assert not dispatcher.is_alive()  # stopped at the first failed submit
        assert scheduler.submit_attempts == 1 and len(scheduler.started) == 0
        assert controller.staleness.get_stats().rejected == 1
    finally:
        controller.destroy()


def test_a_storm_of_rejections_fails_the_run_instead_of_launching_forever(monkeypatch):
    # healthy-looking servers that fail every generation (or an Arena failing every
    # task) reject each rollout: after the limit nothing more is launched
    monkeypatch.setattr(rollout_controller, "COLLECT_TIMEOUT", 0.05)
    scheduler = FakeScheduler(reject_all=True)
    controller, dispatcher = with_dispatch_thread(
        lambda: _controller(scheduler, max_consecutive_rejections=6, max_concurrent_rollouts=1)
    )
    try:
        rows = [[{"id": i}, {"id": i + 1}] for i in range(0, 1000, 2)]
        with pytest.raises(RuntimeError, match="the last 6 rollouts were all rejected"):
            controller.prepare_batch(rows, workflow="w", batch_size=2)
        dispatcher.join(timeout=10)
        assert not dispatcher.is_alive()
        assert len(scheduler.submitted) <= 7  # dispatch stopped at the limit, for good
    finally:
        controller.destroy()
