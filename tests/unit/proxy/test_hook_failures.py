"""A failing agent hook: decision hooks reject the sample (counted), observers do not."""

from __future__ import annotations

import httpx
import pytest

from areal.api.cli_args import AgentConfig, InferenceEngineConfig
from areal.infra import workflow_context
from areal.infra.workflow_executor import WorkflowExecutor
from areal.proxy.hooks import DECISION_HOOKS, OBSERVER_HOOKS, AgentHookError, AgentHooks
from areal.proxy.workflow import OpenAIProxyWorkflow
from areal.utils import stats_tracker
from tests.unit.proxy.conftest import ADMIN, ScriptedEngine, running_proxy


@pytest.fixture
def proxy_url(tokenizer):
    with running_proxy(ScriptedEngine(tokenizer, ["the answer"]), tokenizer) as (url, _):
        yield url


@pytest.fixture(autouse=True)
async def fresh_stats_and_clients():
    stats_tracker.get("rollout").export()  # start from an empty tracker
    yield
    await workflow_context.close_clients()


class HookedAgent:
    """Every hook defined; ``broken`` raises, ``answers`` overrides what a hook returns.

    ``fail`` makes ``run`` raise after one model call, and ``disposition`` is what the
    classifier then says, so that the failure-only hooks are reached too.
    """

    def __init__(self, broken=None, answers=None, fail=None, disposition="model_failure_zero"):
        self.broken, self.answers, self.fail = broken, answers or {}, fail
        self.disposition = disposition
        self.persisted: list = []

    def _answer(self, name, default):
        if name == self.broken:
            raise KeyError(f"{name} looked for a key that is not there")
        return self.answers.get(name, default)

    async def run(self, data, **kwargs):
        response = await kwargs["http_client"].post(
            f"{kwargs['base_url']}/v1/chat/completions",
            headers={"Authorization": f"Bearer {kwargs['api_key']}"},
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        )
        response.raise_for_status()
        if self.fail is not None:
            raise self.fail
        return 0.5

    def get_session_metadata(self, data):
        return self._answer("get_session_metadata", {})

    def classify_proxy_failure(self, error, *, context_overflow, interaction_count):
        return self._answer("classify_proxy_failure", self.disposition)

    async def record_failure_disposition(self, data, error, disposition):
        self._answer("record_failure_disposition", None)

    def should_reject_failed_sample(self, error, disposition):
        return self._answer("should_reject_failed_sample", False)

    def get_failure_reward_for_export(self, data, *, export_style):
        return self._answer("get_failure_reward_for_export", None)

    def get_episode_reward_for_export(self, data, reward, *, export_style):
        return self._answer("get_episode_reward_for_export", None)

    def get_episode_metadata(self):
        return self._answer("get_episode_metadata", {"arena_task_id": "t-1"})

    async def persist_episode_result(self, data, reward):
        self.persisted.append(reward)
        self._answer("persist_episode_result", None)

    def record_episode_metrics(self, data, reward):
        self._answer("record_episode_metrics", None)

    def record_group_metrics(self, data, rewards, group_size):
        self._answer("record_group_metrics", None)


def workflow(agent, url) -> OpenAIProxyWorkflow:
    return OpenAIProxyWorkflow(agent=agent, proxy_addr=url, admin_api_key=ADMIN)


# The hooks a failed episode reaches only through the failure path.
FAILURE_PATH = {
    "classify_proxy_failure",
    "record_failure_disposition",
    "should_reject_failed_sample",
    "get_failure_reward_for_export",
}


def test_every_hook_is_either_a_decision_or_an_observer():
    protocol = {name for name in vars(AgentHooks) if not name.startswith("_")}
    assert protocol == DECISION_HOOKS | OBSERVER_HOOKS
    assert {name for name in vars(HookedAgent) if not name.startswith("_")} == {*protocol, "run"}
    assert not DECISION_HOOKS & OBSERVER_HOOKS


@pytest.mark.parametrize("hook", sorted(DECISION_HOOKS))
async def test_a_failing_decision_hook_rejects_the_sample_and_counts_it(proxy_url, hook):
    fail = RuntimeError("harness crashed") if hook in FAILURE_PATH else None
    agent = HookedAgent(broken=hook, fail=fail)
    with (
        workflow_context.scoped(task_id=1),
        pytest.raises(AgentHookError, match=f"agent hook {hook} failed \\(KeyError: ") as caught,
    ):
        await workflow(agent, proxy_url).arun_episode(None, {"id": 1})
    assert caught.value.hook == hook
    assert isinstance(caught.value.__cause__, KeyError)
    assert agent.persisted == [None]  # audited as untrained
    stats = stats_tracker.get("rollout").export()
    assert stats[f"rollout/rejected/hook_failed/{hook}"] == 1


@pytest.mark.parametrize(
    ("hook", "answer", "objection"),
    [
        ("get_episode_reward_for_export", float("nan"), "not a finite number"),
        ("get_episode_reward_for_export", "1.0", "not a number or None"),
        ("get_episode_reward_for_export", True, "not a number or None"),
        ("get_episode_metadata", ["arena_task_id"], "not a dict or None"),
        ("get_session_metadata", "row-1", "not a dict or None"),
    ],
)
async def test_an_answer_out_of_contract_rejects_the_sample(proxy_url, hook, answer, objection):
    agent = HookedAgent(answers={hook: answer})
    with workflow_context.scoped(task_id=2), pytest.raises(AgentHookError, match=objection):
        await workflow(agent, proxy_url).arun_episode(None, {"id": 2})
    assert stats_tracker.get("rollout").export()[f"rollout/rejected/hook_failed/{hook}"] == 1


async def test_an_unknown_disposition_rejects_the_sample(proxy_url):
    agent = HookedAgent(fail=RuntimeError("harness crashed"), disposition="keep")
    with (
        workflow_context.scoped(task_id=3),
        pytest.raises(AgentHookError, match="returned 'keep', not one of model_failure_zero"),
    ):
        await workflow(agent, proxy_url).arun_episode(None, {"id": 3})
    assert (
        stats_tracker.get("rollout").export()["rollout/rejected/hook_failed/classify_proxy_failure"]
        == 1
    )


@pytest.mark.parametrize("hook", ["persist_episode_result", "record_episode_metrics"])
async def test_a_failing_observer_is_logged_and_the_sample_trains(proxy_url, hook, areal_logs):
    agent = HookedAgent(broken=hook)
    with workflow_context.scoped(task_id=4):
        result = await workflow(agent, proxy_url).arun_episode(None, {"id": 4})
    assert [i.reward for i in result.values()] == [0.5]
    assert f"agent hook {hook} failed (it only observes" in areal_logs.text
    stats = stats_tracker.get("rollout").export()
    assert not any(key.startswith("rollout/rejected/") for key in stats)


async def test_a_failing_group_metrics_hook_is_only_logged(proxy_url, areal_logs):
    agent = HookedAgent(broken="record_group_metrics")
    assert workflow(agent, proxy_url).record_group_metrics({"id": 5}, [1.0, None], 2) is None
    assert "agent hook record_group_metrics failed" in areal_logs.text


def test_the_rejection_reaches_the_rollout_stats_through_the_executor(proxy_url):
    # a broken reward hook: every sample of the group is rejected, so is the rollout
    class Engine:
        def get_version(self):
            return 0

    config = InferenceEngineConfig(consumer_batch_size=1, agent=AgentConfig(admin_api_key=ADMIN))
    executor = WorkflowExecutor(config, Engine())
    executor.initialize()
    try:
        task = executor.submit(
            {"id": "g"},
            HookedAgent,
            {"broken": "get_episode_reward_for_export"},
            group_size=2,
            proxy_addr=proxy_url,
        )
        assert executor.wait_for_task(task, timeout=30) is None
    finally:
        executor.destroy()
    stats = stats_tracker.get("rollout").export()
    assert stats["rollout/rejected"] == 1.0 and stats["rollout/accepted"] == 0.0
    assert stats["rollout/rejected/hook_failed/get_episode_reward_for_export"] == 2


async def test_a_failing_session_metadata_hook_leaves_no_session_slot(proxy_url):
    # the hook is asked before capacity is granted: the next grant is the first one
    with workflow_context.scoped(task_id=6), pytest.raises(AgentHookError):
        await workflow(HookedAgent(broken="get_session_metadata"), proxy_url).arun_episode(
            None, {"id": 6}
        )
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{proxy_url}/grant_capacity", headers={"Authorization": f"Bearer {ADMIN}"}
        )
    assert response.json()["capacity"] == 1
