"""Names that code written against the reference Arena suite imports or patches.

Each test pins one name: the module-level ``asyncio`` and ``time`` of ``arena_client``
(looked up at every wait), ``arena_agent.import_from_string``, the agent's
``stream_configs``, its ``_dump_task_result`` and the session-gateway registry's
``_targets``.
"""

from __future__ import annotations

import httpx
import pytest

from areal.utils import dynamic_import
from examples.swe import arena_agent, arena_client
from examples.swe.arena_agent import ArenaStreamAgentWorkflow
from examples.swe.arena_results import ArenaTaskFailedError
from examples.swe.arena_routes import SessionGatewayRegistry
from examples.swe.arena_types import ArenaStreamConfig
from tests.unit.examples.test_arena_agent_fakes import (
    ARENA_ENV,
    BASE,
    GATEWAY_KEY,
    HARNESS,
    PROXY,
    ROW,
    FakeArena,
    make_agent,
    make_client,
    metrics,
    run_kwargs,
)


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    for name in ARENA_ENV:
        monkeypatch.delenv(name, raising=False)
    metrics()  # start from an empty tracker


@pytest.fixture
def fake() -> FakeArena:
    return FakeArena()


def unavailable(request: httpx.Request) -> httpx.Response:
    return httpx.Response(503, json={"error": "busy"})


# --- arena_client.asyncio / arena_client.time ---


async def test_patched_asyncio_sleep_paces_async_retries_and_polls(fake, monkeypatch):
    client = make_client(fake, retries=2, poll_interval=0.25)  # built before the patch
    sleeps: list[float] = []

    async def no_wait(seconds: float) -> None:
        sleeps.append(seconds)

    monkeypatch.setattr(arena_client.asyncio, "sleep", no_wait)
    fake.script("poll", unavailable)
    fake.polls = [{"status": "RUNNING"}, {"status": "DONE", "score": 1.0}]

    result = await client.launch_one_task_result(
        stream_id="stream-a",
        data_id="data-1",
        model_name="stream-areal-x",
        proxy_base_url=PROXY,
        proxy_api_key="sk-x",
    )

    assert result.score == 1.0
    # poll 1 answers 503: the first retry waits 1 s; poll 2 is RUNNING: one poll interval
    assert sleeps == [1.0, 0.25]
    assert fake.op_names() == ["launch", "poll", "poll", "poll"]


def test_patched_time_paces_blocking_retries(fake, monkeypatch):
    client = make_client(fake, retries=3)
    sleeps: list[float] = []

    class NoWaitTime:
        @staticmethod
        def sleep(seconds: float) -> None:
            sleeps.append(seconds)

    monkeypatch.setattr(arena_client, "time", NoWaitTime)
    fake.script("stream", unavailable, unavailable)

    assert client.resolve_stream("stream-a")["stream_id"] == "stream-a"
    assert sleeps == [1.0, 2.0]  # backoff after the two 503s: 1 s, then doubled


# --- arena_agent.import_from_string ---


async def test_patched_import_from_string_resolves_reward_transforms(fake, monkeypatch):
    assert arena_agent.import_from_string is dynamic_import.import_from_string
    imported: list[str] = []

    def fake_import(path: str):
        imported.append(path)
        return lambda score, data: score / 4

    monkeypatch.setattr(arena_agent, "import_from_string", fake_import)
    agent = make_agent(fake, arena_reward_transform_fn="user_plugins.rewards.quarter")

    assert imported == ["user_plugins.rewards.quarter"]
    assert await agent.run(dict(ROW), **run_kwargs()) == 0.25  # the fake's score 1.0 / 4


# --- stream_configs ---


def test_stream_configs_holds_the_configured_streams_by_name(fake):
    streams = [
        {"name": "swe", "stream_id": "stream-a", "harness": HARNESS},
        {"name": "math", "stream_id": "stream-b", "harness": HARNESS, "reward_threshold": 0.5},
    ]
    agent = make_agent(fake, arena_streams=streams, stream_id="")

    assert list(agent.stream_configs) == ["swe", "math"]
    assert all(isinstance(s, ArenaStreamConfig) for s in agent.stream_configs.values())
    assert [s.stream_id for s in agent.stream_configs.values()] == ["stream-a", "stream-b"]
    assert agent.stream_configs["math"].reward_threshold == 0.5


# --- _dump_task_result ---


class RecordingAgent(ArenaStreamAgentWorkflow):
    """Sends every task result to a list instead of the audit shards."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dumped: list[tuple[str, str, str, str, float | None]] = []

    async def _dump_task_result(self, data, stream_config, result, *, training_score):
        self.dumped.append(
            (data["data_id"], stream_config.name, result.task_id, result.status, training_score)
        )


def recording_agent(fake: FakeArena, **econfig) -> RecordingAgent:
    settings = {"stream_id": "stream-a", "arena_harness": HARNESS, "timeout": 30.0, **econfig}
    return RecordingAgent(settings, arena_client=make_client(fake))


async def test_overridden_dump_task_result_receives_each_task_result(fake):
    # No arena_result_dump_dir: the override is still called, once per episode.
    agent = recording_agent(fake)
    reward = await agent.run(dict(ROW), **run_kwargs())
    await agent.persist_episode_result(dict(ROW), reward)
    await agent.persist_episode_result(dict(ROW), reward)  # already audited: no second record

    fake.polls = [{"status": "RUNNING"}]
    timed_out = recording_agent(fake, timeout=0.05)
    with pytest.raises(TimeoutError):
        await timed_out.run({**ROW, "data_id": "data-2"}, **run_kwargs("sess-2"))

    assert agent.dumped == [("data-1", "default", "task-1", "DONE", 1.0)]
    assert timed_out.dumped == [("data-2", "default", "task-2", "LOCAL_WAIT_TIMEOUT", None)]


async def test_patched_dump_task_result_receives_a_failed_result(fake, monkeypatch):
    fake.polls = [{"status": "EVAL_FAILED", "raw": {"log": "x"}}]
    agent = make_agent(fake)
    seen: list[tuple[str, str]] = []

    async def record(data, stream_config, result, *, training_score):
        seen.append((result.task_id, result.status))

    monkeypatch.setattr(agent, "_dump_task_result", record)
    with pytest.raises(ArenaTaskFailedError) as caught:
        await agent.run(dict(ROW), **run_kwargs())
    await agent.record_failure_disposition(dict(ROW), caught.value, "system_failure_reject")

    assert seen == [("task-1", "EVAL_FAILED")]


# --- SessionGatewayRegistry._targets ---


async def test_registry_targets_is_its_routes_dict(fake):
    client = make_client(fake)
    registry = SessionGatewayRegistry(persistent=True)
    assert registry._targets is registry._routes

    route = await registry.acquire(client, None, PROXY + "/", GATEWAY_KEY, 5.0, 60.0)
    await registry.release(route)  # persistent: the route stays registered

    assert registry._targets is registry._routes
    assert registry._targets == {(BASE, PROXY): route}
    registry.close()
    assert registry._targets is registry._routes and registry._targets == {}
    assert not fake.models  # deleted at close
