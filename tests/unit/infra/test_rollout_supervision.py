"""Health supervision: a dead or frozen inference server, rollout proxy or rollout worker
fails the run within a bounded time, naming it, and nothing more is dispatched to it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from areal.api.cli_args import GRPOConfig, InferenceEngineConfig, SchedulingSpec, load_expr_config
from areal.api.config.fields import FieldError
from areal.api.io_struct import WeightUpdateMeta
from areal.infra.controller.health import HealthSupervisor, HealthTarget, RolloutHealthError
from areal.infra.controller.rollout_controller import RolloutController
from tests.unit.infra.fake_rollout import FakeRolloutScheduler, FakeServer, with_dispatch_thread

INTERVAL = 0.1
TIMEOUT = 0.3


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.kill()


def _supervise(target: HealthTarget, failures: int = 3, quiet=lambda: False):
    seen: list[RolloutHealthError] = []
    supervisor = HealthSupervisor(
        [target],
        interval=INTERVAL,
        timeout=TIMEOUT,
        failures=failures,
        on_failure=seen.append,
        quiet=quiet,
    )
    supervisor.start()
    return supervisor, seen


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# --- the supervisor against a fake server ---


def test_a_killed_server_is_declared_dead_after_n_consecutive_failures(server):
    target = HealthTarget("inference server", server.address, "rollout/0")
    supervisor, seen = _supervise(target, failures=3)
    try:
        # a round starts once the last one is judged: at the 4th probe, three found it alive
        assert _wait_for(lambda: server.hits.count("/health") >= 4, timeout=5.0)
        assert seen == []  # alive: probed, never dead
        killed = time.monotonic()
        server.kill()
        assert _wait_for(lambda: seen, timeout=3.0)
        elapsed = time.monotonic() - killed
    finally:
        supervisor.stop()
    assert elapsed >= 2 * INTERVAL  # three probes, not the first refusal
    (error,) = seen
    assert error.target == target and error.failures == 3
    assert server.address in str(error) and "rollout/0" in str(error)
    assert "3 consecutive health checks" in str(error)


def test_a_single_failed_check_is_not_death(server):
    # streaks 1, 0, 1, 0 with a limit of 2: dead only if a good answer did not reset it
    server.next_status["/health"] = [503, 200, 503]
    supervisor, seen = _supervise(HealthTarget("inference server", server.address, "w"), 2)
    try:
        # a round starts once the last one is judged: at the 5th probe, four were judged
        assert _wait_for(lambda: server.hits.count("/health") >= 5, timeout=5.0)
    finally:
        supervisor.stop()
    assert seen == []


def test_a_frozen_server_that_never_answers_is_dead(server):
    server.delay["/health"] = 5 * TIMEOUT  # accepts the connection, answers too late
    supervisor, seen = _supervise(HealthTarget("inference server", server.address, "w"), 2)
    try:
        assert _wait_for(lambda: seen, timeout=4.0)
    finally:
        supervisor.stop()
        server.delay["/health"] = 0.0
    assert "Timeout" in str(seen[0])


def test_a_worker_dead_with_its_server_and_proxy_is_the_one_named(server):
    worker_rpc, proxy = FakeServer(), FakeServer()
    targets = [
        HealthTarget("inference server", server.address, "rollout/0"),
        HealthTarget("rollout worker", worker_rpc.address, "rollout/0"),
        HealthTarget("rollout proxy", proxy.address, "rollout/0"),
    ]
    seen: list[RolloutHealthError] = []
    supervisor = HealthSupervisor(
        targets, interval=INTERVAL, timeout=TIMEOUT, failures=2, on_failure=seen.append
    )
    try:
        for fake in (server, worker_rpc, proxy):  # its children die with the worker
            fake.kill()
        # the one-off diagnosis after an error seen elsewhere blames the worker as well
        assert supervisor.diagnose().target == targets[1]
        supervisor.start()
        assert _wait_for(lambda: seen, timeout=3.0)
    finally:
        supervisor.stop()
    (error,) = seen
    assert error.target == targets[1] and error.gone_with == (targets[0], targets[2])
    assert str(error).startswith(f"rollout worker rollout/0 at {worker_rpc.address} failed 2 ")
    assert f"its inference server {server.address} and rollout proxy {proxy.address}" in str(error)


def test_paused_servers_are_probed_where_a_paused_scheduler_still_answers(server):
    # SGLang's /health generates one token, which a paused scheduler never does
    server.status["/health"] = 503
    target = HealthTarget("inference server", server.address, "w", quiet_path="/get_model_info")
    supervisor, seen = _supervise(target, failures=2, quiet=lambda: True)
    try:
        # at the 3rd probe the first two (enough to be declared dead) were judged
        assert _wait_for(lambda: server.hits.count("/get_model_info") >= 3, timeout=5.0)
    finally:
        supervisor.stop()
    assert seen == []
    assert "/get_model_info" in server.hits and "/health" not in server.hits


# --- the rollout controller ---


def _controller(scheduler: FakeRolloutScheduler, **overrides: Any) -> RolloutController:
    fields: dict[str, Any] = dict(
        backend="hf:d1",
        experiment_name="exp",
        trial_name="trial",
        consumer_batch_size=2,
        max_head_offpolicyness=0,
        max_concurrent_rollouts=2,
        health_check_interval=INTERVAL,
        health_check_timeout=TIMEOUT,
        health_check_failures=3,
    )
    config = InferenceEngineConfig(**{**fields, **overrides})
    controller = RolloutController(config, scheduler)
    controller.initialize(1, SchedulingSpec(), server_args={})
    return controller


def _prepare_in_thread(controller: RolloutController) -> dict[str, Any]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        rows = ([{"id": i}, {"id": i + 1}] for i in range(0, 10**6, 2))
        try:
            controller.prepare_batch(rows, workflow="w", batch_size=2)
        except Exception as e:
            outcome["error"] = e
            outcome["at"] = time.monotonic()

    threading.Thread(target=run, daemon=True).start()
    return outcome


def test_a_dead_server_stops_the_dispatch_and_fails_prepare_batch(server):
    worker_rpc = FakeServer()
    # every rollout against the dead server fails and is rejected, as in the livelock
    scheduler = FakeRolloutScheduler(
        server.address, worker_rpc.address, outcome=lambda data: None, task_seconds=0.02
    )
    controller, dispatcher = with_dispatch_thread(lambda: _controller(scheduler))
    try:
        outcome = _prepare_in_thread(controller)
        assert _wait_for(lambda: len(scheduler.submitted) >= 4, timeout=5.0)
        killed = time.monotonic()
        server.kill()
        assert _wait_for(lambda: "error" in outcome, timeout=5.0), "prepare_batch never failed"
        error = outcome["error"]
        assert isinstance(error, RolloutHealthError)
        assert f"inference server {server.address}" in str(error)
        assert "rollout/0" in str(error)
        assert outcome["at"] - killed < 3.0
        dispatcher.join(timeout=10)
        assert not dispatcher.is_alive()  # stopped by the detection, for good
        detected = outcome["at"]
        assert all(at <= detected for _, at in scheduler.submitted)
        with pytest.raises(RolloutHealthError):  # and every call to the workers says so
            controller.set_version(1)
    finally:
        controller.destroy()
        worker_rpc.kill()


def test_a_gone_rollout_worker_fails_the_run_naming_it(server):
    worker_rpc = FakeServer()
    scheduler = FakeRolloutScheduler(server.address, worker_rpc.address, task_seconds=30.0)
    controller = _controller(scheduler)
    try:
        outcome = _prepare_in_thread(controller)
        assert _wait_for(lambda: len(scheduler.submitted) >= 2, timeout=5.0)
        worker_rpc.kill()
        assert _wait_for(lambda: "error" in outcome, timeout=5.0), "prepare_batch never failed"
    finally:
        controller.destroy()
    assert f"rollout worker rollout/0 at {worker_rpc.address}" in str(outcome["error"])


def test_a_dead_proxy_started_after_the_workers_fails_the_run_naming_it(server):
    worker_rpc, proxy = FakeServer(), FakeServer()
    scheduler = FakeRolloutScheduler(
        server.address, worker_rpc.address, task_seconds=30.0, proxy_addr=proxy.address
    )
    controller = _controller(scheduler)
    try:
        assert controller.start_proxies("tokenizer") == [f"http://{proxy.address}"]
        outcome = _prepare_in_thread(controller)
        assert _wait_for(lambda: "/health" in proxy.hits, timeout=3.0)  # now supervised
        killed = time.monotonic()
        proxy.kill()
        assert _wait_for(lambda: "error" in outcome, timeout=5.0), "prepare_batch never failed"
    finally:
        controller.destroy()
        worker_rpc.kill()
    assert f"rollout proxy {proxy.address} (rollout worker rollout/0)" in str(outcome["error"])
    assert outcome["at"] - killed < 3.0


def test_a_weight_update_towards_a_frozen_server_fails_instead_of_hanging(server):
    worker_rpc = FakeServer()
    scheduler = FakeRolloutScheduler(server.address, worker_rpc.address)
    scheduler.hold_updates = True  # the update call never returns, like a frozen server
    controller = _controller(scheduler)
    try:
        server.delay["/get_model_info"] = 5 * TIMEOUT  # frozen: probed on the quiet path
        began = time.monotonic()
        # the rollout side's half of the controller's weight-sync handshake
        with pytest.raises(RuntimeError, match=f"inference server {server.address}"):
            controller.receive_weights(WeightUpdateMeta(type="disk", path=None, version=1))
        assert time.monotonic() - began < 4.0
    finally:
        scheduler.released.set()
        server.delay["/get_model_info"] = 0.0
        controller.destroy()
        worker_rpc.kill()


# --- configuration ---


def test_health_check_fields_are_validated_at_load(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_FILEROOT", str(tmp_path))
    config, _ = load_expr_config(
        ["--config", "examples/toy/toy_grpo.yaml", "rollout.health_check_interval=2.5"],
        GRPOConfig,
    )
    assert config.rollout.health_check_interval == 2.5
    assert (config.rollout.health_check_timeout, config.rollout.health_check_failures) == (5.0, 3)
    with pytest.raises(FieldError, match=r"rollout\.health_check_interval"):
        load_expr_config(
            ["--config", "examples/toy/toy_grpo.yaml", "rollout.health_check_interval=-1"],
            GRPOConfig,
        )
    with pytest.raises(FieldError, match=r"^health_check_failures"):
        InferenceEngineConfig(health_check_failures=0)
    with pytest.raises(FieldError, match=r"^health_check_timeout"):
        InferenceEngineConfig(health_check_timeout=0)


# --- the trainer: an error caused by a dead server names the server ---


def test_an_error_caused_by_a_dead_server_is_reported_as_that_server(server):
    from areal.trainer.rl_trainer import PPOTrainer

    worker_rpc = FakeServer()
    scheduler = FakeRolloutScheduler(server.address, worker_rpc.address)
    # long checks: only the diagnosis after the failure can find the dead server in time
    controller = _controller(scheduler, health_check_interval=3600.0)
    trainer = PPOTrainer.__new__(PPOTrainer)  # only the step wrapper is exercised
    trainer.rollout = controller
    try:
        # servers alive: an unrelated error stays what it is
        with pytest.raises(ValueError, match="unrelated"), trainer._failures_named():
            raise ValueError("unrelated")
        server.kill()
        expected = f"inference server {server.address}"
        with pytest.raises(RolloutHealthError, match=expected) as info, trainer._failures_named():
            raise RuntimeError("begin_weight_update: HTTP 500")  # what the step saw
        assert "begin_weight_update" in str(info.value.__cause__)
        with pytest.raises(RolloutHealthError):  # and the dispatch is stopped as well
            controller.check_health()
    finally:
        controller.destroy()
        worker_rpc.kill()
