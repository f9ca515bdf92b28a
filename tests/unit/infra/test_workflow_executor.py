"""WorkflowExecutor and grouped workflows: staleness under load, rejection, failures."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from areal.api.cli_args import InferenceEngineConfig
from areal.api.workflow_api import RolloutWorkflow
from areal.infra import workflow_context
from areal.infra.grouped_workflow import GroupedRolloutWorkflow, resolve_workflow
from areal.infra.staleness_manager import StalenessManager
from areal.infra.workflow_executor import WorkflowExecutor


class FakeEngine:
    def __init__(self) -> None:
        self.version = 0

    def get_version(self) -> int:
        return self.version


class Loader:
    """A dataloader of row lists with a ``batch_size``."""

    def __init__(self, rows: list, batch_size: int):
        self.rows, self.batch_size = rows, batch_size

    def __iter__(self):
        for i in range(0, len(self.rows), self.batch_size):
            yield self.rows[i : i + self.batch_size]


class VersionRecorder(RolloutWorkflow):
    """Records the weight version at start; sleeps a little; rejects odd rows if asked."""

    def __init__(self, reject_odd: bool = False, fail_every: int = 0):
        self.reject_odd, self.fail_every = reject_odd, fail_every

    async def arun_episode(self, engine, data):
        start = engine.get_version()
        await asyncio.sleep(random.uniform(0.001, 0.02))
        if self.fail_every and data % self.fail_every == 0:
            raise RuntimeError(f"row {data} failed")
        if self.reject_odd and data % 2:
            return None
        return {"row": torch.tensor([[data]]), "start_version": torch.tensor([[start]])}


def make_executor(engine, **overrides) -> WorkflowExecutor:
    config = InferenceEngineConfig(
        consumer_batch_size=overrides.pop("batch", 4),
        max_concurrent_rollouts=overrides.pop("concurrent", 16),
        max_head_offpolicyness=overrides.pop("eta", 1),
        **overrides,
    )
    # in-process, with no rollout controller: the executor holds the staleness gate
    executor = WorkflowExecutor(
        config, engine, StalenessManager.from_config(config, engine.get_version)
    )
    executor.initialize()
    return executor


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def executor(engine):
    ex = make_executor(engine)
    yield ex
    ex.destroy()


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_staleness_bound_holds_under_load(engine, eta):
    ex = make_executor(engine, eta=eta, concurrent=32, batch=4)
    try:
        loader = Loader(list(range(1000)), batch_size=4)
        for version in range(8):
            batch = ex.prepare_batch(loader, VersionRecorder())
            assert len(batch) == 4
            starts = [int(t["start_version"]) for t in batch]
            # a batch consumed at version v holds no rollout started before v - eta
            assert min(starts) >= version - eta, (version, starts)
            stats = ex.staleness.get_stats()
            assert stats.accepted + stats.running <= (eta + version + 1) * 4
            engine.version = version + 1
            ex.notify()
    finally:
        ex.destroy()


def test_rejected_results_do_not_count(engine):
    # With eta 0 only one batch of 4 may be in flight at version 0: if rejected rollouts
    # kept their slots, half of them being rejected would stall this batch forever.
    ex = make_executor(engine, eta=0, concurrent=4, batch=4)
    try:
        batch = ex.prepare_batch(Loader(list(range(100)), 4), VersionRecorder(reject_odd=True))
        assert len(batch) == 4 and all(int(t["row"]) % 2 == 0 for t in batch)
        stats = ex.staleness.get_stats()
        assert stats.accepted == 4 and stats.rejected >= 2
    finally:
        ex.destroy()


def test_dynamic_batch_size_returns_after_enough_attempts(engine):
    ex = make_executor(engine, eta=0, concurrent=4, batch=4)
    try:
        batch = ex.prepare_batch(
            Loader(list(range(100)), 4), VersionRecorder(reject_odd=True), dynamic_bs=True
        )
        assert len(batch) < 4 and all(int(t["row"]) % 2 == 0 for t in batch)
    finally:
        ex.destroy()


def test_a_failing_task_does_not_kill_the_runner(executor, areal_logs):
    ids = [executor.submit(row, VersionRecorder(fail_every=3)) for row in range(9)]
    results = {task_id: executor.wait_for_task(task_id, timeout=10) for task_id in ids}
    assert [results[i] is None for i in ids] == [True, False, False] * 3
    assert "rollout task 0 failed" in areal_logs.text
    later = executor.submit(1, VersionRecorder())
    assert int(executor.wait_for_task(later, timeout=10)["row"]) == 1


def test_wait_returns_oldest_results_and_times_out(executor):
    for row in range(6):
        executor.submit(row, VersionRecorder())
    rows = sorted(int(t["row"]) for t in executor.wait(6, timeout=10))
    assert rows == list(range(6))
    with pytest.raises(TimeoutError):
        executor.wait(1, timeout=0.2)
    assert executor.wait(1, timeout=0.2, raise_timeout=False) == []


def test_rollout_batch_keeps_row_order(executor):
    results = executor.rollout_batch([3, 1, 2], VersionRecorder, {})
    assert [int(t["row"]) for t in results] == [3, 1, 2]


def test_workflow_import_path_and_kwargs(executor):
    path = f"{__name__}.VersionRecorder"
    task = executor.submit(5, path, {"reject_odd": True})
    assert executor.wait_for_task(task, timeout=10) is None
    with pytest.raises(ValueError, match="workflow_kwargs"):
        executor.submit(5, VersionRecorder)
    with pytest.raises(TypeError, match="neither a RolloutWorkflow nor an agent"):
        executor.submit(5, object())


def test_should_accept_fn(executor):
    task = executor.submit(4, VersionRecorder(), should_accept_fn=lambda t: int(t["row"]) > 10)
    assert executor.wait_for_task(task, timeout=10) is None
    task = executor.submit(12, VersionRecorder(), should_accept_fn=lambda t: int(t["row"]) > 10)
    assert executor.wait_for_task(task, timeout=10) is not None


def test_a_closed_barrier_holds_new_tasks(executor):
    executor.barrier.begin()
    task = executor.submit(1, VersionRecorder())
    with pytest.raises(TimeoutError):
        executor.wait_for_task(task, timeout=0.3)
    executor.barrier.end(0)
    executor.notify()
    assert executor.wait_for_task(task, timeout=10) is not None


def test_finished_tasks_are_delivered_until_acknowledged(executor):
    assert executor.collect_finished(timeout=0.1) == []  # nothing finished: waits, then []
    task = executor.submit(1, VersionRecorder())
    first = executor.collect_finished(timeout=10)
    assert [task_id for task_id, _ in first] == [task] and int(first[0][1]["row"]) == 1
    # the answer may have been lost on its way: it comes again until acknowledged
    assert [task_id for task_id, _ in executor.collect_finished(timeout=0.1)] == [task]
    assert executor.collect_finished(ack=[task], timeout=0.1) == []


def test_eval_tasks_see_their_context(executor):
    seen = []

    class Probe(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            context = workflow_context.get()
            seen.append((context.is_eval, context.task_id, workflow_context.stat_scope()))
            return {"x": torch.zeros(1, 1)}

    task = executor.submit(0, Probe(), is_eval=True, task_id=77)
    executor.wait_for_task(task, timeout=10)
    assert seen == [(True, 77, "eval-rollout")]


# --- groups ---


class Sample(RolloutWorkflow):
    """Sample i sleeps delays[i] then returns outcomes[i] (None rejects; 'raise' raises)."""

    def __init__(self, outcomes, delays):
        self.outcomes, self.delays = outcomes, delays
        self.cancelled: list[int] = []
        self.indices: list[int] = []

    async def arun_episode(self, engine, data):
        index = workflow_context.get().sample_idx
        self.indices.append(index)
        try:
            await asyncio.sleep(self.delays[index])
        except asyncio.CancelledError:
            self.cancelled.append(index)
            raise
        outcome = self.outcomes[index]
        if outcome == "raise":
            raise RuntimeError("sample failed")
        return (
            None
            if outcome is None
            else {"value": torch.tensor([[outcome, outcome]])[:, : 1 + index % 2]}
        )


async def test_group_samples_see_their_index_and_merge():
    inner = Sample([1, 2, 3], [0, 0, 0])
    result = await GroupedRolloutWorkflow(inner, 3).arun_episode(FakeEngine(), {})
    assert sorted(inner.indices) == [0, 1, 2]
    # tensors of lengths 1, 2, 1 are right-padded to 2 and stacked in sample order
    assert result["value"].tolist() == [[1, 0], [2, 2], [3, 0]]


async def test_incomplete_group_keeps_valid_samples():
    inner = Sample([1, None, "raise"], [0, 0, 0])
    result = await GroupedRolloutWorkflow(inner, 3).arun_episode(FakeEngine(), {})
    assert result["value"].tolist() == [[1]]


async def test_drop_incomplete_group_cancels_running_siblings():
    inner = Sample([1, None, 3], [5.0, 0.0, 5.0])
    start = time.monotonic()
    result = await GroupedRolloutWorkflow(inner, 3, drop_incomplete_group=True).arun_episode(
        FakeEngine(), {}
    )
    assert result is None
    assert time.monotonic() - start < 2.0  # the slow siblings did not run to the end
    assert sorted(inner.cancelled) == [0, 2]


async def test_all_rejected_group_is_none():
    inner = Sample([None, None], [0, 0])
    assert await GroupedRolloutWorkflow(inner, 2).arun_episode(FakeEngine(), {}) is None


def test_resolve_wraps_groups():
    wrapped = resolve_workflow(VersionRecorder(), group_size=4, drop_incomplete_group=True)
    assert isinstance(wrapped, GroupedRolloutWorkflow) and wrapped.group_size == 4
    assert isinstance(resolve_workflow(VersionRecorder()), VersionRecorder)


def test_grouped_submit_through_the_executor(executor):
    inner = Sample([1, 2], [0, 0])
    task = executor.submit({}, inner, group_size=2)
    assert executor.wait_for_task(task, timeout=10)["value"].shape[0] == 2


def test_runner_error_surfaces_on_the_next_call(engine):
    ex = make_executor(engine)
    ex._error = RuntimeError("runner died")
    with pytest.raises(RuntimeError, match="runner has stopped"):
        ex.submit(1, VersionRecorder())
    ex._error = None
    ex.destroy()


def test_threads_are_cleaned_up(engine):
    before = threading.active_count()
    ex = make_executor(engine)
    ex.destroy()
    time.sleep(0.1)
    assert threading.active_count() <= before
