"""Typed engine calls: controllers reach engines only through proxies of their interfaces.

The proxy refuses an undeclared name (``AttributeError``) and a call that does not bind to
the interface method (``TypeError``) before anything is sent; the controllers hold no
method names as strings; and driving each controller through its public methods against
a recording scheduler calls only methods its engine interface declares.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from areal.api.cli_args import InferenceEngineConfig, SchedulingSpec
from areal.api.engine_api import (
    InferenceEngine,
    PPOActorEngine,
    RolloutWorkerEngine,
    TrainEngine,
    interface_methods,
)
from areal.api.io_struct import FinetuneSpec, ParamSpec, SaveLoadMeta, WeightUpdateMeta
from areal.api.scheduler_api import Job, Worker
from areal.infra.controller.rollout_controller import RolloutController
from areal.infra.controller.train_controller import TrainController
from areal.infra.rpc.loop import on_rpc_loop, run_sync
from areal.infra.rpc.remote_engine import RemoteEngine
from tests.unit.infra.fake_scheduler import SyncEngineCalls

REPO = Path(__file__).resolve().parents[3]
CONTROLLERS = sorted((REPO / "areal" / "infra" / "controller").glob("*.py"))


class Recorder(SyncEngineCalls):
    """Records every engine call; ``answer(worker_id, method, args, kwargs)`` replies."""

    def __init__(self, answer=lambda worker_id, method, args, kwargs: None, n_workers: int = 2):
        self.answer = answer
        self.n_workers = n_workers
        self.calls: list[tuple[str, str, tuple, dict]] = []
        self.lock = threading.Lock()

    def create_workers(self, job: Job) -> list[str]:
        return [f"{job.role}/{i}" for i in range(job.replicas)]

    def get_workers(self, role: str, timeout: float | None = None) -> list[Worker]:
        return [Worker(f"{role}/{i}", "127.0.0.1", ["1", "2"]) for i in range(self.n_workers)]

    async def set_worker_env(self, worker_id: str, env: dict[str, str]) -> None:
        pass

    async def create_engine(self, worker_id: str, engine: str, *args: Any, **kwargs: Any) -> str:
        return worker_id

    def delete_workers(self, role: str | None = None) -> None:
        pass

    def call_engine(self, worker_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            self.calls.append((worker_id, method, args, kwargs))
        return self.answer(worker_id, method, args, kwargs)

    def methods(self) -> set[str]:
        with self.lock:
            return {method for _, method, _, _ in self.calls}


# --- the proxy ---


def test_an_undeclared_name_is_an_attribute_error_naming_the_interface():
    engine = RemoteEngine(Recorder(), "actor/0", TrainEngine)
    with pytest.raises(AttributeError, match=r"TrainEngine has no method 'trian_batch'"):
        engine.trian_batch  # noqa: B018
    with pytest.raises(AttributeError, match="property"):
        engine.data_parallel_rank  # noqa: B018
    with pytest.raises(AttributeError):
        RemoteEngine(Recorder(), "rollout/0", InferenceEngine).collect_finished  # noqa: B018
    assert not hasattr(engine, "__await__")  # not mistaken for an awaitable


def test_a_call_that_does_not_bind_is_a_type_error_before_anything_is_sent():
    scheduler = Recorder()
    engine = RemoteEngine(scheduler, "rollout/0", RolloutWorkerEngine)
    with pytest.raises(TypeError, match=r"RolloutWorkerEngine\.collect_finished"):
        engine.collect_finished([1], 1.0, "extra")
    with pytest.raises(TypeError, match="unexpected keyword"):
        engine.set_version(version=1, when="now")
    with pytest.raises(TypeError, match="with_options"):
        engine.submit({"x": 1}, "w", rpc_meta={})  # how a call travels is no argument
    with pytest.raises(TypeError, match="missing"):
        engine.launch_proxy.acall()
    with pytest.raises(TypeError, match="unknown RPC options"):
        engine.with_options(timeout=3)
    assert scheduler.calls == []


def test_calls_reach_the_scheduler_as_written_with_the_proxys_options():
    scheduler = Recorder(answer=lambda *call: "done")
    engine = RemoteEngine(scheduler, "rollout/1", RolloutWorkerEngine)
    assert engine.submit({"x": 1}, "w", task_id=7, group_size=2) == "done"
    quiet = engine.with_options(rpc_meta={"broadcast": False}, max_retries=1)
    assert run_sync(quiet.collect_finished.acall([3], timeout=0.5)) == "done"
    assert run_sync(quiet.export_stats.follow_head()) == "done"
    assert scheduler.calls == [
        ("rollout/1", "submit", ({"x": 1}, "w"), {"engine_name": "rollout/1", "task_id": 7,
                                                   "group_size": 2}),
        ("rollout/1", "collect_finished", ([3],), {"engine_name": "rollout/1",
                                                   "rpc_meta": {"broadcast": False},
                                                   "max_retries": 1, "timeout": 0.5}),
        ("rollout/1", "export_stats", (), {"engine_name": "rollout/1",
                                           "rpc_meta": {"broadcast": False}, "max_retries": 1}),
    ]  # fmt: skip


def test_a_class_that_is_no_interface_is_refused():
    with pytest.raises(TypeError, match="not an engine interface"):
        RemoteEngine(Recorder(), "actor/0", int)


# --- the RPC loop ---


def test_rpc_coroutines_run_on_the_one_rpc_loop_whoever_awaits_them():
    @on_rpc_loop
    async def where() -> str:
        return threading.current_thread().name

    assert run_sync(where()) == "rpc-loop"
    assert asyncio.run(where()) == "rpc-loop"  # handed over from another loop

    async def nested() -> None:
        run_sync(where())

    with pytest.raises(RuntimeError, match="wait for itself"):
        run_sync(nested())


# --- the controllers hold no method names ---


def _interface_names() -> set[str]:
    return set(interface_methods(PPOActorEngine) | interface_methods(RolloutWorkerEngine))


def test_controllers_name_no_engine_method_in_a_string_and_call_no_scheduler_by_name():
    names = _interface_names()
    offenders = []
    for path in CONTROLLERS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                offenders.append(f"{path.name}:{node.lineno}: the string {node.value!r}")
            if isinstance(node, ast.Attribute) and node.attr in (
                "call_engine",
                "async_call_engine",
            ):
                offenders.append(f"{path.name}:{node.lineno}: {node.attr} by name")
    assert not offenders, "call engines through RemoteEngine proxies:\n" + "\n".join(offenders)


# --- every call a controller makes is a method of its engine interface ---


def _batch(n_groups: int) -> list[dict[str, torch.Tensor]]:
    return [
        {
            "input_ids": torch.ones(2, 3 + g, dtype=torch.long),
            "attention_mask": torch.ones(2, 3 + g, dtype=torch.bool),
        }
        for g in range(n_groups)
    ]


def _train_answer(worker_id: str, method: str, args: tuple, kwargs: dict) -> Any:
    rank = int(worker_id.split("/")[1])
    if method == "data_parallel_layout":
        return {"dp_rank": rank, "dp_size": 2, "is_head": True}
    if method == "compute_logp":
        return args[0]["input_ids"].float()
    if method == "compute_advantages":
        return {"advantages": args[0]["input_ids"].float()}
    if method == "ppo_update":
        return [{"loss": 1.0}]
    if method == "weight_group_address":
        return args[0]
    if method == "weight_buckets":
        return [[ParamSpec("w", (2,), "float32")]]
    return {} if method == "export_stats" else None


class _RolloutSide:
    def init_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        pass


def test_the_train_controller_calls_only_what_ppo_actor_engine_declares():
    scheduler = Recorder(_train_answer)
    ctl = TrainController("some.Engine", None, scheduler)
    ctl.initialize(2, SchedulingSpec(), FinetuneSpec(1, 8, 8))
    batch = _batch(3)
    assert len(ctl.compute_logp(batch)) == 3
    assert len(ctl.compute_advantages(batch)) == 3
    assert ctl.ppo_update(batch) == [{"loss": 1.0}]
    ctl.step_lr_scheduler()
    ctl.connect_engine(_RolloutSide(), WeightUpdateMeta(type="xccl", gen_n_servers=1))
    ctl.send_weights(WeightUpdateMeta(type="disk", path="/tmp/w"))
    ctl.set_version(1)
    ctl.get_version()
    ctl.save(SaveLoadMeta(path="/tmp/ckpt"))
    ctl.load(SaveLoadMeta(path="/tmp/ckpt"))
    assert ctl.export_stats() == {}
    ctl.destroy()
    called = scheduler.methods()
    assert called <= interface_methods(PPOActorEngine), called - interface_methods(PPOActorEngine)
    assert {"compute_logp", "ppo_update", "send_weights", "weight_buckets", "save"} <= called


def _rollout_answer(worker_id: str, method: str, args: tuple, kwargs: dict) -> Any:
    if method == "launch_local_server":
        return "127.0.0.1:1"
    if method == "launch_proxy":
        return "http://127.0.0.1:2"
    if method == "submit":
        _rollout_answer.finished[kwargs["task_id"]] = {"task": kwargs["task_id"]}
        return kwargs["task_id"]
    if method == "collect_finished":
        for task_id in args[0]:
            _rollout_answer.finished.pop(task_id, None)
        return list(_rollout_answer.finished.items())
    return {} if method == "export_stats" else None


def test_the_rollout_controller_calls_only_what_rollout_worker_engine_declares():
    _rollout_answer.finished = {}
    scheduler = Recorder(_rollout_answer, n_workers=1)
    config = InferenceEngineConfig(
        backend="hf:d1",
        consumer_batch_size=2,
        max_concurrent_rollouts=2,
        health_check_interval=0,
    )
    ctl = RolloutController(config, scheduler)
    ctl.initialize(1, SchedulingSpec(), server_args={})
    try:
        ctl.start_proxies("tokenizer", expected_temperature=1.0)
        rows = [[{"id": i}, {"id": i + 1}] for i in range(0, 100, 2)]
        assert len(ctl.prepare_batch(rows, workflow="w", batch_size=2, proxy_addr="x")) == 2
        ctl.begin_weight_update(1)
        ctl.offload()
        ctl.onload()
        ctl.init_weights_update_group(WeightUpdateMeta(type="xccl", gen_n_servers=1))
        buckets = [[ParamSpec("w", (2,), "float32")]]
        ctl.receive_weights(WeightUpdateMeta(type="xccl", version=1), buckets)
        ctl.receive_weights(WeightUpdateMeta(type="disk", path=None, version=1))
        ctl.end_weight_update(1)
        ctl.export_stats()
    finally:
        ctl.destroy()
    called = scheduler.methods()
    declared = interface_methods(RolloutWorkerEngine)
    assert called <= declared, called - declared
    expected = {"launch_local_server", "initialize", "launch_proxy", "submit", "collect_finished"}
    expected |= {"begin_weight_update", "update_weights_from_distributed", "resume_serving"}
    assert expected <= called


# --- the engines implement the interfaces the controllers call ---


def _accepts(implementation: Any, declared: inspect.Signature) -> bool:
    """Whether every call that binds to ``declared`` binds to ``implementation`` too: the
    same positional parameters in the same order, and every keyword taken."""
    params = inspect.signature(implementation).parameters
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ours = [p.name for p in declared.parameters.values() if p.kind in positional]
    theirs = [p.name for p in params.values() if p.kind in positional]
    if theirs[: len(ours)] != ours:
        return False
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
    keywords = [p.name for p in declared.parameters.values() if p.kind is p.KEYWORD_ONLY]
    return all(name in params or any_keyword for name in keywords)


@pytest.mark.parametrize(
    ("engine", "interface"),
    [
        ("areal.engine.sglang_remote.RemoteSGLangEngine", RolloutWorkerEngine),
        ("areal.trainer.ppo.actor.FSDPPPOActor", PPOActorEngine),
        ("areal.trainer.ppo.actor.MegatronPPOActor", PPOActorEngine),
    ],
)
def test_the_engines_controllers_create_implement_their_interface(engine, interface):
    from areal.utils.dynamic_import import import_from_string

    cls = import_from_string(engine)
    assert issubclass(cls, interface) and not cls.__abstractmethods__
    for name in interface_methods(interface):
        declared = inspect.signature(getattr(interface, name))
        assert _accepts(getattr(cls, name), declared), f"{cls.__name__}.{name}{declared}"
