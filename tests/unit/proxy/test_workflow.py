"""OpenAIProxyWorkflow: agents run against the proxy; rewards, failures, hooks, export."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import torch

from areal.api.cli_args import AgentConfig, InferenceEngineConfig
from areal.infra import workflow_context
from areal.infra.workflow_executor import WorkflowExecutor
from areal.proxy.hooks import AgentHookError
from areal.proxy.keys import derive_gateway_key, derive_session_token
from areal.proxy.workflow import HARNESS_OUTCOME_METRIC_CODES, OpenAIProxyWorkflow
from areal.utils import stats_tracker
from tests.unit.proxy.conftest import ADMIN, ScriptedEngine, running_proxy


@pytest.fixture
def proxy(tokenizer):
    with running_proxy(
        ScriptedEngine(tokenizer, ["the answer"]), tokenizer, engine_max_tokens=200
    ) as (url, server):
        yield url, server


@pytest.fixture(autouse=True)
async def close_clients():
    yield
    await workflow_context.close_clients()


def first_session_id(server, task_id: str) -> str:
    """The id of the first session a fresh proxy starts for ``task_id``."""
    return f"{task_id}-0.{server.store.run_nonce}"


async def chat(kwargs, content: str = "hi") -> httpx.Response:
    return await kwargs["http_client"].post(
        f"{kwargs['base_url']}/v1/chat/completions",
        headers={"Authorization": f"Bearer {kwargs['api_key']}"},
        json={"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8},
    )


class Agent:
    def __init__(self, reward=1.0, calls=1, fail=None, overflow=False, hooks=False):
        self.reward, self.calls, self.fail, self.overflow = reward, calls, fail, overflow
        self.seen_kwargs = None
        self.events: list = []

    async def run(self, data, **kwargs):
        self.seen_kwargs = kwargs
        for i in range(self.calls):
            (await chat(kwargs, f"call {i}")).raise_for_status()
        if self.overflow:
            response = await chat(kwargs, "word " * 500)
            assert response.status_code == 400
        if self.fail:
            raise self.fail
        return self.reward


class HookedAgent(Agent):
    disposition = "model_failure_zero"

    def get_session_metadata(self, data):
        return {"row": data["id"]}

    def get_episode_metadata(self):
        return {"arena_task_id": "t-1"}

    def classify_proxy_failure(self, error, *, context_overflow, interaction_count):
        self.events.append(("classify", type(error).__name__, context_overflow, interaction_count))
        return self.disposition

    def record_failure_disposition(self, data, error, disposition):
        self.events.append(("disposition", disposition))

    async def persist_episode_result(self, data, reward):
        self.events.append(("persist", reward))

    def record_episode_metrics(self, data, reward):
        self.events.append(("metrics", reward))


def workflow(agent, url, **kwargs) -> OpenAIProxyWorkflow:
    return OpenAIProxyWorkflow(agent=agent, proxy_addr=url, admin_api_key=ADMIN, **kwargs)


def test_constructor_checks_the_agent():
    class Sync:
        def run(self, data):
            return 1.0

    with pytest.raises(TypeError, match="async def"):
        OpenAIProxyWorkflow(agent=Sync(), proxy_addr="http://x", admin_api_key=ADMIN)
    with pytest.raises(ValueError, match="inline"):
        OpenAIProxyWorkflow(
            mode="online", agent=Agent(), proxy_addr="http://x", admin_api_key=ADMIN
        )
    assert "AGENT_MAX_TURNS_EXCEEDED" in HARNESS_OUTCOME_METRIC_CODES


async def test_successful_episode_exports_with_the_reward(proxy):
    url, server = proxy
    stats_tracker.get("rollout").export()  # start from an empty tracker
    agent = Agent(reward=0.75, calls=2)
    with workflow_context.scoped(task_id=17, sample_idx=3):
        result = await workflow(agent, url).arun_episode(engine="runtime", data={"id": "d1"})
    assert len(result) == 2 and [i.reward for i in result.values()] == [0.75, 0.75]  # discount 1
    kwargs = agent.seen_kwargs
    session_id = first_session_id(server, "17:3")
    assert kwargs["session_id"] == session_id
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}", kwargs["session_id"])
    assert kwargs["proxy_gateway_api_key"] == derive_gateway_key(ADMIN) != ADMIN
    assert kwargs["proxy_session_token"] == derive_session_token(ADMIN, session_id)
    assert kwargs["worker_runtime"] == "runtime" and kwargs["api_key"] != ADMIN
    assert server.store.get(session_id) is None  # exported and removed
    tensors = next(iter(result.values())).to_tensor_dict()
    assert tensors["rewards"].tolist() == [0.75] and tensors["loss_mask"].sum() > 0
    stats = stats_tracker.get("rollout").export()
    # the session scalars on every path (they used to be recorded on reject paths only)
    assert stats["rollout/context_overflow"] == 0.0 and stats["rollout/proxy_system_error"] == 0.0
    # turn counts of the last interaction replace the old num_interactions scalar
    assert stats["rollout/num_turns_count"] == 1 and stats["rollout/num_turns/avg"] == 1.0
    assert stats["rollout/num_turns_no_harness_err_count"] == 1
    assert "rollout/num_turns_harness_err_count" not in stats
    assert "rollout/num_interactions" not in stats


async def test_integer_and_per_interaction_rewards(proxy, monkeypatch):
    url, _ = proxy
    with workflow_context.scoped(task_id=1):
        result = await workflow(Agent(reward=1), url).arun_episode(None, {"id": 1})
    assert next(iter(result.values())).reward == 1.0

    class PerCall(Agent):
        async def run(self, data, **kwargs):
            ids = [(await chat(kwargs)).json()["id"] for _ in range(2)]
            return {ids[0]: 0.2, ids[1]: 0.9}

    with workflow_context.scoped(task_id=2):
        result = await workflow(PerCall(), url, discount=0.0).arun_episode(None, {"id": 2})
    assert [i.reward for i in result.values()] == [0.2, 0.9]


@pytest.mark.parametrize("reward", ["high", None, float("nan")])
async def test_bad_rewards_reject_the_sample(proxy, reward):
    url, _ = proxy
    with workflow_context.scoped(task_id=3), pytest.raises(ValueError, match="reward"):
        await workflow(Agent(reward=reward), url).arun_episode(None, {"id": 3})


async def test_agent_failure_without_hooks_is_rejected(proxy):
    url, server = proxy
    with workflow_context.scoped(task_id=4), pytest.raises(RuntimeError, match="harness crashed"):
        await workflow(Agent(fail=RuntimeError("harness crashed")), url).arun_episode(
            None, {"id": 4}
        )
    assert server.store.get(first_session_id(server, "4")).finished  # still ended


async def test_context_overflow_trains_with_zero_reward(proxy):
    url, _ = proxy
    agent = Agent(calls=1, overflow=True, fail=RuntimeError("prompt too long"))
    with workflow_context.scoped(task_id=5):
        result = await workflow(agent, url).arun_episode(None, {"id": 5})
    assert [i.reward for i in result.values()] == [0.0]


async def test_overflow_without_interactions_is_dropped(proxy):
    url, _ = proxy
    agent = HookedAgent(calls=0, overflow=True)
    with workflow_context.scoped(task_id=6):
        assert await workflow(agent, url).arun_episode(None, {"id": 6}) is None
    assert ("persist", None) in agent.events


async def test_hooks_classify_and_record(proxy):
    url, _ = proxy
    agent = HookedAgent(calls=2, fail=TimeoutError("slow harness"))
    with workflow_context.scoped(task_id=7):
        result = await workflow(agent, url).arun_episode(None, {"id": "row-7"})
    assert [i.reward for i in result.values()] == [0.0, 0.0]  # forced zero, discounted back
    assert agent.events[:2] == [
        ("classify", "TimeoutError", False, 2),
        ("disposition", "model_failure_zero"),
    ]
    assert ("persist", 0.0) in agent.events and ("metrics", 0.0) in agent.events
    assert all(i.metadata["arena_task_id"] == "t-1" for i in result.values())
    agent = HookedAgent(fail=RuntimeError("x"))
    agent.disposition = "unknown_failure_reject"
    with workflow_context.scoped(task_id=8), pytest.raises(RuntimeError):
        await workflow(agent, url).arun_episode(None, {"id": 8})
    agent.disposition = "keep"
    with (
        workflow_context.scoped(task_id=9),
        pytest.raises(AgentHookError, match="classify_proxy_failure"),
    ):
        await workflow(agent, url).arun_episode(None, {"id": 9})


async def test_system_error_rejects_even_if_the_agent_would_keep_it(tokenizer):
    class Broken(ScriptedEngine):
        async def agenerate(self, req):
            raise RuntimeError("engine down")

    class Failing(HookedAgent):
        async def run(self, data, **kwargs):
            (await chat(kwargs)).raise_for_status()

    with running_proxy(Broken(tokenizer), tokenizer) as (url, _):
        agent = Failing()
        with workflow_context.scoped(task_id=10), pytest.raises(httpx.HTTPStatusError):
            await workflow(agent, url).arun_episode(None, {"id": 10})
    assert ("disposition", "system_failure_reject") in agent.events
    assert not any(e[0] == "classify" for e in agent.events)


async def test_empty_export_is_rejected(proxy):
    url, _ = proxy
    agent = HookedAgent(calls=0)
    with workflow_context.scoped(task_id=11):
        assert await workflow(agent, url).arun_episode(None, {"id": 11}) is None
    assert ("persist", None) in agent.events


async def test_cancelled_episode_still_ends_its_session(proxy):
    url, server = proxy

    class Slow(Agent):
        async def run(self, data, **kwargs):
            (await chat(kwargs)).raise_for_status()
            await asyncio.sleep(30)

    with workflow_context.scoped(task_id=12):
        task = asyncio.create_task(workflow(Slow(), url).arun_episode(None, {"id": 12}))
        session_id = first_session_id(server, "12")
        while server.store.get(session_id) is None or not len(server.store.get(session_id).cache):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert server.store.get(session_id).finished


def test_agents_run_through_the_executor_with_group_normalization(proxy):
    url, _ = proxy

    class Scored:
        def __init__(self, base: float = 0.0):
            self.base = base

        async def run(self, data, **kwargs):
            (await chat(kwargs)).raise_for_status()
            return self.base + workflow_context.get().sample_idx

    class Engine:
        def get_version(self):
            return 0

    stats_tracker.get("rollout").export()  # start from an empty tracker
    config = InferenceEngineConfig(consumer_batch_size=1, agent=AgentConfig(admin_api_key=ADMIN))
    executor = WorkflowExecutor(config, Engine())
    executor.initialize()
    try:
        task = executor.submit(
            {"id": "g"},
            Scored,
            {"base": 1.0},
            group_size=2,
            proxy_addr=url,
            reward_normalization=True,
        )
        batch = executor.wait_for_task(task, timeout=30)
    finally:
        executor.destroy()
    # sample rewards 1 and 2: mean 1.5, population std 0.5 -> normalized -1 and +1
    assert batch["rewards"].tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)
    assert batch["original_rewards"].tolist() == [1.0, 2.0]
    assert batch["input_ids"].shape[0] == 2 and batch["loss_mask"].dtype == torch.int64
    stats = stats_tracker.get("rollout").export()
    assert stats["rollout/reward"] == pytest.approx(1.5)
