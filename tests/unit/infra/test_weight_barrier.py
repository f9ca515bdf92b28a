"""One weight-update barrier (docs/design.md#one-pause-and-version-source): the only pause
path of the rollout side, and a weight-sync handshake the controller runs, trainer and
inference concurrently."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from areal.api.cli_args import InferenceEngineConfig, SchedulingSpec
from areal.api.io_struct import ParamSpec, WeightUpdateMeta
from areal.api.scheduler_api import Job, Worker
from areal.engine import weight_sync
from areal.engine.sglang_remote import RemoteInfEngine
from areal.infra.controller.rollout_controller import RolloutController
from areal.infra.weight_barrier import BarrierState
from tests.unit.infra.fake_scheduler import SyncEngineCalls

REPO = Path(__file__).resolve().parents[3]


# --- the shared state ---


def _read_in_child(path: str, out: Any) -> None:
    view = BarrierState.attach(path)
    out.put((view.closed, view.version))


def test_another_process_reads_the_same_pause_and_version():
    state = BarrierState(version=4)
    try:
        view = BarrierState.attach(state.path)
        assert (view.closed, view.version) == (False, 4)
        state.begin()
        assert (view.closed, view.version) == (True, 4)  # begin keeps the version
        state.end(5)
        assert (view.closed, view.version) == (False, 5)
        state.begin()
        queue = multiprocessing.get_context("spawn").Queue()
        child = multiprocessing.get_context("spawn").Process(
            target=_read_in_child, args=(state.path, queue)
        )
        child.start()
        assert queue.get(timeout=60) == (True, 5)  # a proxy process sees the same word
        child.join(timeout=30)
        with pytest.raises(RuntimeError, match="belongs to its rollout worker"):
            view.end(6)  # a reader never writes
    finally:
        state.close()
    assert not Path(state.path).exists()


async def test_held_counts_the_callers_waiting_at_a_closed_barrier():
    state = BarrierState(version=2)
    try:
        assert await state.wait_open() == 2 and state.held == 0  # open: never held
        state.begin()
        waiters = [asyncio.create_task(state.wait_open()) for _ in range(2)]
        await asyncio.sleep(0)  # one turn of the loop: both run up to their first poll
        assert state.held == 2 and not any(waiter.done() for waiter in waiters)
        state.end(3)
        assert await asyncio.gather(*waiters) == [3, 3]  # the version set on opening
        assert state.held == 0
    finally:
        state.close()


# --- nothing left behind, however the owner ends ---

OWNER = """
import subprocess, sys, time
from areal.infra.weight_barrier import BarrierState

state = BarrierState(version=3)
state.begin()
reader = "import sys; from areal.infra.weight_barrier import BarrierState as B; "
reader += "v = B.attach(sys.argv[1]); print(v.closed, v.version)"
seen = subprocess.run([sys.executable, "-c", reader, state.path], capture_output=True,
                      text=True, check=True).stdout.split()
print(*seen, flush=True)  # a proxy, attached by the path it was given
end = sys.argv[1]
if end == "exception":
    raise RuntimeError("the rollout worker failed")
elif end == "signal":
    time.sleep(120)
# "exit": ends without close(), as a worker whose engine is never destroyed
"""


def _run_until_its_end(argv: list[str], end: str, tmp: Path) -> tuple[int, str]:
    """Run ``argv`` with ``$TMPDIR`` at ``tmp``; ``signal``/``kill``: SIGTERM/SIGKILL its
    process group once it printed a line. Its status and first line."""
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        first = process.stdout.readline()
        if end in ("signal", "kill"):
            os.killpg(process.pid, signal.SIGTERM if end == "signal" else signal.SIGKILL)
        process.communicate(timeout=120)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # its children (a proxy) end too
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("children of the owner outlived it")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, first


@pytest.mark.parametrize(
    ("end", "status"), [("exit", 0), ("exception", 1), ("signal", -15), ("kill", -9)]
)
def test_no_barrier_file_is_left_however_the_owner_ends(tmp_path, end, status):
    # close() is covered above; these owners never call it
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "-c", OWNER, "signal" if end == "kill" else end]
    returncode, first = _run_until_its_end(argv, end, tmp)
    assert first.split() == ["True", "3"]  # the reader saw the closed state and its version
    assert returncode == status
    assert list(tmp.iterdir()) == []  # no /tmp/areal-barrier-*.bin, for any ending


# --- the controller's barrier ---


class RecordingScheduler(SyncEngineCalls):
    """One rollout worker; tasks finish at once; every engine call is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.finished: dict[int, Any] = {}
        self.lock = threading.Lock()

    def create_workers(self, job: Job) -> list[str]:
        return [f"{job.role}/0"]

    def get_workers(self, role: str, timeout: float | None = None) -> list[Worker]:
        return [Worker(f"{role}/0", "127.0.0.1", ["1"])]

    async def create_engine(self, *args: Any, **kwargs: Any) -> str:
        return "rollout/0"

    def delete_workers(self, role: str | None = None) -> None:
        pass

    def submitted(self) -> list[int]:
        with self.lock:
            return [args[0] for method, args in self.calls if method == "submit"]

    def call_engine(self, worker_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("engine_name", None)
        if method == "launch_local_server":
            return "127.0.0.1:1"
        if method == "collect_finished":
            (ack,) = args
            time.sleep(0.01)
            with self.lock:
                for task_id in ack:
                    self.finished.pop(task_id, None)
                return list(self.finished.items())
        with self.lock:
            if method == "submit":
                self.calls.append((method, (kwargs["task_id"],)))
                self.finished[kwargs["task_id"]] = {"task": kwargs["task_id"]}
                return kwargs["task_id"]
            self.calls.append((method, args))
        return None


def _controller(scheduler: RecordingScheduler) -> RolloutController:
    config = InferenceEngineConfig(
        backend="hf:d1",
        consumer_batch_size=2,
        max_head_offpolicyness=100,  # the barrier alone holds the dispatch here
        max_concurrent_rollouts=2,
        health_check_interval=0,
    )
    controller = RolloutController(config, scheduler)
    controller.initialize(1, SchedulingSpec(), server_args={})
    return controller


def test_begin_stops_dispatch_and_end_sets_the_version_everywhere_and_resumes():
    scheduler = RecordingScheduler()
    controller = _controller(scheduler)
    rows = [[{"id": i}, {"id": i + 1}] for i in range(0, 1000, 2)]
    try:
        assert len(controller.prepare_batch(rows, workflow="w", batch_size=2)) == 2
        controller.begin_weight_update(1)
        controller.begin_weight_update(1)  # idempotent: the workers hear it once
        # Every dispatch counts a running rollout at once; begin returns with the count
        # final (running + accepted + rejected keeps its sum). Once the submits of those
        # rollouts are in, nothing else was dispatched inside the barrier.
        stats = controller.staleness.get_stats()
        held = stats.running + stats.accepted + stats.rejected
        deadline = time.monotonic() + 10
        while len(scheduler.submitted()) < held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(scheduler.submitted()) == held  # nothing dispatched inside the barrier
        controller.receive_weights(WeightUpdateMeta(type="disk", path=None, version=1))
        assert len(scheduler.submitted()) == held  # still held after the weights are in
        controller.end_weight_update(1)
        assert controller.get_version() == 1
        assert len(controller.prepare_batch(rows, workflow="w", batch_size=2)) == 2
        assert len(controller.prepare_batch(rows, workflow="w", batch_size=2)) == 2
        assert len(scheduler.submitted()) > held  # dispatching again
    finally:
        controller.destroy()
    update = ("begin_weight_update", "update_weights_from_disk", "resume_serving")
    update += ("end_weight_update",)
    worker_calls = [(m, a) for m, a in scheduler.calls if m in update]
    # closed once; the servers serve once they hold the weights; end then sets the version
    # on the worker, which its executor, its servers' weight version and its proxies read
    assert [m for m, _ in worker_calls] == list(update)
    assert worker_calls[0][1] == (1,) and worker_calls[-1][1] == (1,)


def test_the_barrier_is_the_only_pause_path():
    for cls in (RolloutController, RemoteInfEngine):
        for name in ("pause", "resume", "pause_generation", "continue_generation"):
            assert not hasattr(cls, name), f"{cls.__name__}.{name} is a second pause path"
        assert callable(cls.begin_weight_update) and callable(cls.end_weight_update)
    from areal.infra.workflow_executor import WorkflowExecutor

    assert not hasattr(WorkflowExecutor, "pause") and not hasattr(WorkflowExecutor, "resume")
    from areal.proxy.server import ProxyServer

    for name in ("pause", "resume", "set_version"):  # proxies read the worker's barrier
        assert not hasattr(ProxyServer, name)


# --- the handshake, run by the controller ---


class Halves:
    """A trainer and a rollout side whose halves only finish when both run at once."""

    def __init__(self, fail_receive: bool = False) -> None:
        self.meeting = threading.Barrier(2, timeout=5)
        self.fail_receive = fail_receive
        self.events: list[str] = []

    def send_weights(self, meta: WeightUpdateMeta) -> None:
        self.events.append("send")
        if self.fail_receive:
            time.sleep(30)  # stuck in a collective the servers left
        self.meeting.wait()  # broken (an error) unless the receive runs meanwhile

    def receive_weights(self, meta: WeightUpdateMeta, buckets: Any) -> None:
        self.events.append("receive")
        if self.fail_receive:
            raise RuntimeError("HTTP 400: no tensor model.no_such.weight")
        self.meeting.wait()

    # connect's halves
    def weight_group_address(self, meta: WeightUpdateMeta) -> WeightUpdateMeta:
        return WeightUpdateMeta(
            type="xccl", nccl_master_address="10.0.0.9", nccl_master_port=4321, comm_backend="gloo"
        )

    def join_weight_group(self, meta: WeightUpdateMeta) -> None:
        self.meeting.wait()

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        assert meta.nccl_master_address == "10.0.0.9"  # the trainer's choice reached them
        self.meeting.wait()

    def weight_buckets(self, meta: WeightUpdateMeta) -> list[list[ParamSpec]]:
        return [[ParamSpec("w", (2,), "float32")]]


@pytest.mark.parametrize("kind", ["disk", "xccl"])
def test_the_controller_runs_trainer_send_and_inference_receive_concurrently(kind):
    halves = Halves()
    meta = WeightUpdateMeta(type=kind, path="/tmp/w", version=3)
    buckets = [[ParamSpec("w", (2,), "float32")]] if kind == "xccl" else None
    weight_sync.push_weights(halves, halves, meta, buckets)  # would break the barrier if serial
    assert sorted(halves.events) == ["receive", "send"]


def test_connect_joins_both_sides_of_the_group_concurrently():
    halves = Halves()
    meta = WeightUpdateMeta(type="xccl", gen_n_servers=1)
    plan = weight_sync.connect_weight_sync(halves, halves, meta)
    assert (meta.nccl_master_address, meta.nccl_master_port, meta.comm_backend) == (
        "10.0.0.9",
        4321,
        "gloo",
    )
    assert plan == [[ParamSpec("w", (2,), "float32")]]


def test_a_refusing_inference_side_fails_the_update_at_once():
    halves = Halves(fail_receive=True)
    begin = time.monotonic()
    with pytest.raises(RuntimeError, match=r"refused a weight bucket.*no_such"):
        weight_sync.push_weights(halves, halves, WeightUpdateMeta(type="xccl", version=1), [[]])
    assert time.monotonic() - begin < 5  # not the trainer's stuck collective


def test_the_trainer_brackets_the_push_with_the_barrier():
    from areal.trainer.rl_trainer import PPOTrainer

    order: list[str] = []

    class Rollout:
        def begin_weight_update(self, version):
            order.append(f"begin {version}")

        def receive_weights(self, meta, buckets):
            order.append(f"receive v{meta.version}")

        def end_weight_update(self, version):
            order.append(f"end {version}")

    class Actor:
        weight_plan = None

        def send_weights(self, meta):
            order.append(f"send v{meta.version}")

        def set_version(self, version):
            order.append(f"actor {version}")

    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.rollout, trainer.actor = Rollout(), Actor()
    trainer.weight_update_meta = WeightUpdateMeta(type="disk", path="/tmp/weight_update")
    trainer._push_weights(2)
    assert order[0] == "begin 2" and order[-2:] == ["actor 2", "end 2"]
    assert sorted(order[1:3]) == ["receive v2", "send v2"]
    order.clear()
    trainer._push_weights(3, resume=False)  # the loop ends the barrier after its checkpoint
    assert order[-1] == "actor 3"


# --- no callback server anywhere ---


def test_no_module_defines_or_imports_a_callback_server():
    assert not (REPO / "areal" / "infra" / "controller" / "callback.py").exists()
    forbidden = {"CallbackServer", "RolloutCallback", "callback_addr", "rollout_complete"}
    offenders = []
    for root in ("areal", "examples", "bench"):
        for path in (REPO / root).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names: set[str] = set()
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    names = {node.name}
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = {a.name.rsplit(".", 1)[-1] for a in node.names}
                    if isinstance(node, ast.ImportFrom) and node.module:
                        names.add(node.module)
                elif isinstance(node, ast.Name):
                    names = {node.id}
                elif isinstance(node, (ast.arg, ast.keyword)) and node.arg:
                    names = {node.arg}
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names = {w for w in forbidden if w in node.value}
                hits = names & forbidden | {n for n in names if n.endswith("controller.callback")}
                if hits:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {sorted(hits)}")
    assert offenders == []
