"""The proxy workflow's public metric hooks, named trackers and late proxy address."""

from __future__ import annotations

import inspect

import pytest

from areal.infra import workflow_context
from areal.proxy.workflow import OpenAIProxyWorkflow, harness_flags
from areal.utils import stats_tracker
from tests.unit.proxy.conftest import ADMIN, ScriptedEngine, running_proxy
from tests.unit.proxy.test_workflow import Agent, HookedAgent, workflow


@pytest.fixture
def proxy(tokenizer):
    with running_proxy(ScriptedEngine(tokenizer, ["the answer"]), tokenizer) as (url, server):
        yield url, server


@pytest.fixture(autouse=True)
async def clean_trackers():
    stats_tracker.export_all()
    yield
    await workflow_context.close_clients()
    stats_tracker.export_all()


def test_record_episode_metrics_is_synchronous_and_skips_a_missing_reward():
    agent = HookedAgent()
    flow = OpenAIProxyWorkflow(agent=agent, proxy_addr="http://x", admin_api_key=ADMIN)
    assert not inspect.iscoroutinefunction(flow.record_episode_metrics)
    assert flow.record_episode_metrics({"id": 1}, None) is None
    assert agent.events == []
    flow.record_episode_metrics({"id": 1}, 0.25)
    assert agent.events == [("metrics", 0.25)]


def test_record_episode_metrics_without_an_agent_hook_does_nothing():
    flow = OpenAIProxyWorkflow(agent=Agent(), proxy_addr="http://x", admin_api_key=ADMIN)
    flow.record_episode_metrics({"id": 1}, 1.0)  # Agent has no hook: nothing to call


async def test_the_workflow_calls_an_overriding_record_episode_metrics(proxy):
    url, _ = proxy
    seen = []

    class Recording(OpenAIProxyWorkflow):
        def record_episode_metrics(self, data, reward):
            seen.append((data["id"], reward))
            super().record_episode_metrics(data, reward)

    agent = HookedAgent(reward=0.5)
    flow = Recording(agent=agent, proxy_addr=url, admin_api_key=ADMIN)
    result = await flow.arun_episode(engine=None, data={"id": "d7"})
    assert [i.reward for i in result.values()] == [0.5]
    assert seen == [("d7", 0.5)]
    assert ("metrics", 0.5) in agent.events  # the base method still forwards


async def test_a_failing_override_is_logged_and_the_sample_stands(proxy, areal_logs):
    url, _ = proxy

    class Broken(OpenAIProxyWorkflow):
        def record_episode_metrics(self, data, reward):
            raise RuntimeError("metrics backend down")

    flow = Broken(agent=Agent(reward=1.0), proxy_addr=url, admin_api_key=ADMIN)
    result = await flow.arun_episode(engine=None, data={"id": "d8"})
    assert [i.reward for i in result.values()] == [1.0]
    assert "recording the metrics of session" in areal_logs.text
    assert "metrics backend down" in areal_logs.text


@pytest.mark.parametrize("hook", ["record_episode_metrics", "record_group_metrics"])
def test_an_async_metrics_hook_is_refused_at_construction(hook):
    async def hook_fn(self, *args):
        return None

    agent_type = type("AsyncHooks", (Agent,), {hook: hook_fn})
    with pytest.raises(TypeError, match=f"AsyncHooks.{hook} must be a plain 'def' method"):
        OpenAIProxyWorkflow(agent=agent_type(), proxy_addr="http://x", admin_api_key=ADMIN)


async def test_built_without_a_proxy_address_it_fails_only_when_an_episode_runs():
    flow = OpenAIProxyWorkflow(agent=Agent(), admin_api_key=ADMIN)
    assert flow.proxy_addr is None
    with pytest.raises(ValueError, match="no proxy address: set proxy_addr"):
        await flow.arun_episode(engine=None, data={"id": 1})
    flow.proxy_addr = "http://127.0.0.1:1"  # a rollout worker fills it in
    assert flow.proxy_addr.startswith("http://")


async def test_episode_metrics_land_in_the_scope_tracker_under_its_name(proxy):
    url, _ = proxy
    with workflow_context.scoped(is_eval=True):
        await workflow(Agent(reward=1.0), url).arun_episode(engine=None, data={"id": "e1"})
    evaluation = stats_tracker.get("eval-rollout").export()
    assert evaluation["eval-rollout/reward"] == 1.0
    assert evaluation["eval-rollout/num_turns_count"] == 1
    assert evaluation["eval-rollout/context_overflow"] == 0.0
    assert not any(k.startswith("rollout/") for k in stats_tracker.get("rollout").export())


class Exported:
    def __init__(self, metadata):
        self.metadata = metadata
        self.reward = 1.0

    def to_tensor_dict(self):
        import torch

        return {"turn_ids": torch.tensor([0, 0, 1])}


def test_record_interaction_stats_takes_the_harness_flags_as_arguments():
    flow = OpenAIProxyWorkflow(agent=Agent(), admin_api_key=ADMIN)
    exported = {"i": Exported({})}  # the metadata says no harness error...
    flow._record_interaction_stats(exported, True, "AGENT_RUN_TIMEOUT")  # ...the flags do
    stats = stats_tracker.get("rollout").export()
    assert stats["rollout/num_turns_harness_err_count"] == 1
    assert stats["rollout/num_turns_harness_err/AGENT_RUN_TIMEOUT_count"] == 1
    assert stats["rollout/num_turns_no_harness_err_count"] == 0
    flow._record_interaction_stats(exported, False, None)
    stats = stats_tracker.get("rollout").export()
    assert "rollout/num_turns_harness_err_count" not in stats
    assert stats["rollout/num_turns/avg"] == 2.0


def test_harness_flags_read_the_last_interaction():
    failed = {"arena_status": "HARNESS_FAILED", "harness_outcome_code": "LLM_RESPONSE_FAILED"}
    assert harness_flags({"a": Exported({}), "b": Exported(failed)}) == (
        True,
        "LLM_RESPONSE_FAILED",
    )
    assert harness_flags({"a": Exported(failed), "b": Exported({})}) == (False, None)
    assert harness_flags({}) == (False, None)
