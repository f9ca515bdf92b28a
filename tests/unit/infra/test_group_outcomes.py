"""Group outcomes: reward normalization with a failed sample, the group-metrics hook, and
the per-task deadline of the executor."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest
import torch

from areal.api.cli_args import InferenceEngineConfig
from areal.api.workflow_api import RolloutWorkflow
from areal.infra import workflow_context
from areal.infra.grouped_workflow import GroupedRolloutWorkflow
from areal.infra.staleness_manager import StalenessManager
from areal.infra.workflow_executor import DEADLINE_GRACE_S, WorkflowExecutor
from areal.proxy.interaction import ExportedInteraction
from areal.proxy.workflow import OpenAIProxyWorkflow
from areal.utils import stats_tracker


class FakeEngine:
    def get_version(self) -> int:
        return 0


def interactions(sample: int, reward: float) -> dict[str, ExportedInteraction]:
    """Two turns of one sample, both rewarded ``reward`` (as a turn discount of 1 gives)."""
    out = {}
    for turn in range(2):
        tensors = {
            "input_ids": torch.tensor([[sample, turn]]),
            "rewards": torch.tensor([reward]),
        }
        out[f"s{sample}-t{turn}"] = ExportedInteraction(f"s{sample}-t{turn}", reward, tensors)
    return out


class Scripted(RolloutWorkflow):
    """Sample i returns ``make(i)`` after ``delays[i]`` seconds (None or raising rejects it);
    records the group-metrics calls it gets."""

    def __init__(self, make, delays=None):
        self.make, self.delays = make, delays
        self.group_calls: list[tuple[dict, list, int]] = []

    async def arun_episode(self, engine, data):
        index = workflow_context.get().sample_idx
        if self.delays:
            await asyncio.sleep(self.delays[index])
        return self.make(index)

    def record_group_metrics(self, data, rewards, group_size):
        self.group_calls.append((data, rewards, group_size))


def _fail(index):
    raise RuntimeError(f"sample {index} failed")


# --- rollout-time reward normalization ---


async def test_normalization_trains_the_rest_of_a_group_with_a_failed_sample():
    rewards = [1.0, None, 0.0, 1.0]  # sample 1 fails
    inner = Scripted(lambda i: _fail(i) if rewards[i] is None else interactions(i, rewards[i]))
    group = GroupedRolloutWorkflow(inner, 4, reward_normalization=True)
    result = await group.arun_episode(FakeEngine(), {"row": 7})
    assert sorted({key.split("-")[0] for key in result}) == ["s0", "s2", "s3"]
    # over the 3 kept scores [1, 0, 1]: mean 2/3, population std sqrt(2/9) = 0.4714
    # -> (1 - 2/3) / 0.4714 = 0.7071 and (0 - 2/3) / 0.4714 = -1.4142
    assert result["s0-t0"].reward == pytest.approx(0.70710, abs=1e-4)
    assert result["s2-t1"].reward == pytest.approx(-1.41421, abs=1e-4)
    assert result["s3-t1"].tensors["original_rewards"].tolist() == [1.0]
    assert inner.group_calls == [({"row": 7}, [1.0, None, 0.0, 1.0], 4)]  # before normalizing


async def test_normalization_keeps_a_group_of_tensor_dicts():
    scores = [2.0, 4.0, None]
    inner = Scripted(
        lambda i: (
            None
            if scores[i] is None
            else {"input_ids": torch.tensor([[i, i]]), "rewards": torch.tensor([scores[i]])}
        )
    )
    result = await GroupedRolloutWorkflow(inner, 3, reward_normalization=True).arun_episode(
        FakeEngine(), {}
    )
    # two rows: [2, 4] -> mean 3, std 1 -> [-1, 1]
    assert result["input_ids"].tolist() == [[0, 0], [1, 1]]
    assert result["rewards"].tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)
    assert result["original_rewards"].tolist() == [2.0, 4.0]


# --- the group-metrics hook ---


async def test_group_metrics_are_recorded_once_with_cancelled_siblings_as_none():
    inner = Scripted(
        lambda i: None if i == 1 else {"rewards": torch.tensor([1.0])}, delays=[5.0, 0.0, 0.0]
    )
    group = GroupedRolloutWorkflow(inner, 3, drop_incomplete_group=True)
    assert await group.arun_episode(FakeEngine(), {}) is None
    # sample 1 was rejected; sample 0 was cancelled; sample 2 finished with it or not
    assert len(inner.group_calls) == 1
    _, rewards, size = inner.group_calls[0]
    assert size == 3 and rewards[0] is None and rewards[1] is None


async def test_the_proxy_workflow_hands_group_metrics_to_its_agent():
    seen = []

    class Agent:
        async def run(self, data, **kwargs):
            return 1.0

        def record_group_metrics(self, data, rewards, group_size):
            seen.append((rewards, group_size))

    workflow = OpenAIProxyWorkflow(
        agent=Agent(), proxy_addr="http://127.0.0.1:1", admin_api_key="k"
    )
    assert not inspect.iscoroutinefunction(workflow.record_group_metrics)
    workflow.record_group_metrics({}, [1.0, None], 2)
    assert seen == [([1.0, None], 2)]
    # and through the group, once per group
    group = GroupedRolloutWorkflow(workflow, group_size=2)
    await group._record_group_metrics({}, [None, None])
    assert seen[-1] == ([None, None], 2)


# --- the per-task deadline ---


class Hung(RolloutWorkflow):
    def __init__(self):
        self.cancelled = asyncio.Event()

    async def arun_episode(self, engine, data):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_a_hung_task_is_rejected_after_its_deadline_and_frees_its_slot():
    config = InferenceEngineConfig(
        consumer_batch_size=1, max_concurrent_rollouts=1, request_timeout=0.3
    )
    engine = FakeEngine()
    executor = WorkflowExecutor(
        config, engine, StalenessManager.from_config(config, engine.get_version)
    )
    executor.initialize()
    stats_tracker.get("rollout").export()
    try:
        hung = Hung()
        start = time.monotonic()
        task = executor.submit({}, hung)
        assert executor.wait_for_task(task, timeout=10) is None  # rejected
        assert 0.3 <= time.monotonic() - start < 5
        assert hung.cancelled.is_set()
        stats = executor.staleness.get_stats()
        assert (stats.running, stats.rejected) == (0, 1)
        assert executor.get_capacity() == 1  # the slot is free again
        exported = stats_tracker.get("rollout").export()
        assert exported["rollout/timed_out"] == 1.0 and exported["rollout/rejected"] == 1.0
    finally:
        executor.destroy()


def test_the_deadline_follows_a_longer_workflow_timeout():
    executor = WorkflowExecutor(InferenceEngineConfig(request_timeout=600), FakeEngine())
    assert executor.task_deadline(None) == 600
    assert executor.task_deadline({"timeout": 100}) == 600
    assert executor.task_deadline({"timeout": 1800}) == 1800 + DEADLINE_GRACE_S
