"""Strictly shaped clients and controllers drive the agent and the rollout-only tool end to end.

The agent, the route helpers and the rollout-only tool call the Arena client the way the
reference suite's users do: the Stream or route identifier of ``resolve_stream[_async]``,
``llm_proxy_exists_async``, ``renew_llm_proxy_async`` and ``delete_llm_proxy[_async]`` is
passed positionally, every other argument (and every argument of the other client methods
and of the rollout controller) by keyword. The fakes here pin exactly that: their
identifier parameters are positional-only (``/``) and all other parameters keyword-only
(``*``), so passing an identifier by keyword, or anything else positionally, anywhere on
the path fails with ``TypeError``.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import httpx
import pytest
import torch

from areal.utils.dynamic_import import import_from_string
from examples.swe import arena_rollout_only, arena_routes
from examples.swe.arena_client import ArenaOpenAPIClient
from examples.swe.arena_rollout_only import _run_rollout_tasks, registry_smoke, select_rows
from examples.swe.train_swe_rl import ARENA_WORKFLOW, pin_streams_for_workers
from examples.swe.utils import SWEEnvConfig
from tests.conftest import SWE_DIR
from tests.unit.examples import test_train_swe_rl as training
from tests.unit.examples.test_arena_agent_fakes import (
    ARENA_ENV,
    HARNESS,
    PROXY,
    ROW,
    SESSION_KEY,
    FakeArena,
    FakeClock,
    FakeRuntime,
    StrictCallArenaClient,
    make_agent,
    make_client,
    metrics,
    run_kwargs,
)
from tests.unit.examples.test_arena_rollout_only import ADMIN_KEY, SmokePeers


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    for name in ARENA_ENV:
        monkeypatch.delenv(name, raising=False)
    metrics()  # start from an empty tracker


@pytest.fixture
def fake() -> FakeArena:
    return FakeArena()


class KeywordOnlyController:
    """A rollout controller taking keywords only; it runs each submitted row through the
    workflow it names, with a strict Arena client over ``fake``."""

    def __init__(self, *, fake: FakeArena, proxy_addr: str = PROXY):
        self.fake = fake
        self.proxy_addr = proxy_addr
        self.pending: dict[int, tuple[dict, Any, dict]] = {}
        self.submitted: list[dict[str, Any]] = []
        self.clients: list[StrictCallArenaClient] = []

    def submit(
        self,
        *,
        data: dict[str, Any],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> int:
        self.submitted.append({"workflow": workflow, **kwargs})
        task_id = len(self.pending)
        self.pending[task_id] = (data, workflow, dict(workflow_kwargs or {}))
        return task_id

    def wait_for_task(
        self, *, task_id: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> dict[str, Any]:
        data, workflow, workflow_kwargs = self.pending.pop(task_id)
        client = StrictCallArenaClient(inner=make_client(self.fake))
        self.clients.append(client)
        agent = import_from_string(workflow)(**workflow_kwargs, arena_client=client)
        session = f"sess-{task_id}"
        reward = asyncio.run(
            agent.run(data, base_url=self.proxy_addr, api_key=SESSION_KEY, session_id=session)
        )
        return {"rewards": torch.tensor([reward])}


class KeywordOnlyEngine(KeywordOnlyController):
    """The rollout-only tool's inference engine (server, proxy, lifecycle), keywords only."""

    last: KeywordOnlyEngine | None = None
    fake_for_next: FakeArena | None = None

    def __init__(self, *, config: Any, staleness: Any = None):
        assert KeywordOnlyEngine.fake_for_next is not None
        super().__init__(fake=KeywordOnlyEngine.fake_for_next)
        self.config = config
        self.staleness = staleness  # the tool's own gate: concurrency only
        self.lifecycle: list[str] = []
        KeywordOnlyEngine.last = self

    def launch_local_server(self, *, server_args: dict[str, Any]) -> str:
        self.lifecycle.append("launch_local_server")
        return "127.0.0.1:30000"

    def initialize(self, *, engine_id: str | None = None, addr: Any = None) -> None:
        self.lifecycle.append(f"initialize {addr}")

    def launch_proxy(self, *, tokenizer_path: str) -> str:
        self.lifecycle.append("launch_proxy")
        return self.proxy_addr

    def destroy(self) -> None:
        self.lifecycle.append("destroy")


# The client methods whose first parameter is the Stream or route identifier.
IDENTIFIER_FIRST = {
    "resolve_stream": "stream_id",
    "resolve_stream_async": "stream_id",
    "llm_proxy_exists_async": "model_name",
    "renew_llm_proxy_async": "model_name",
    "delete_llm_proxy": "model_name",
    "delete_llm_proxy_async": "model_name",
}
KEYWORDS = {inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD}


def public_methods(cls: type) -> list[tuple[str, list[inspect.Parameter]]]:
    return [
        (name, list(inspect.signature(member).parameters.values())[1:])  # without self
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") or name == "__init__"
    ]


def test_the_fakes_pin_the_call_shapes():
    for cls in (StrictCallArenaClient, KeywordOnlyController, KeywordOnlyEngine):
        for name, params in public_methods(cls):
            if cls is StrictCallArenaClient and name in IDENTIFIER_FIRST:
                first, params = params[0], params[1:]
                assert first.name == IDENTIFIER_FIRST[name], name
                assert first.kind is inspect.Parameter.POSITIONAL_ONLY, name
            assert {p.kind for p in params} <= KEYWORDS, f"{cls.__name__}.{name}"


def test_the_real_client_takes_the_identifier_first_and_the_rest_by_keyword():
    methods = dict(public_methods(ArenaOpenAPIClient))
    for name, identifier in IDENTIFIER_FIRST.items():
        first, *rest = methods[name]
        assert first.name == identifier, name
        assert first.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, name
        assert {p.kind for p in rest} <= KEYWORDS, name


def test_route_renewal_takes_the_route_name_first_and_the_rest_by_keyword():
    first, *rest = inspect.signature(arena_routes.renew_gateway_route).parameters.values()
    assert first.name == "model_name"
    assert first.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert {p.kind for p in rest} <= KEYWORDS


async def test_the_strict_client_refuses_other_call_shapes(fake):
    client = StrictCallArenaClient(inner=make_client(fake))
    with pytest.raises(TypeError):
        await client.delete_llm_proxy_async(model_name="stream-areal-x")
    with pytest.raises(TypeError):
        await client.renew_llm_proxy_async("stream-areal-x", None)
    with pytest.raises(TypeError):
        client.resolve_stream(stream_id="stream-a")
    assert client.calls == [] and fake.calls == []


# --- the agent, in each route mode ---


async def test_direct_route_with_a_strict_client(fake):
    fake.streams["stream-a"]["default_reward_ref"] = {"key": "grader", "version": "1"}
    row = {**ROW, "reward_ref_key": "grader", "reward_ref_version": "1"}
    agent = make_agent(
        fake,
        strict_calls=True,
        arena_llm_route_mode="direct",
        arena_streams=[
            {
                "name": "default",
                "stream_id": "stream-a",
                "harness": HARNESS,
                "expected_reward_ref": {"key": "grader", "version": "1"},
            }
        ],
        stream_id="",
    )

    assert await agent.run(row, **run_kwargs()) == 1.0

    assert agent.client.calls == ["resolve_stream_async", "launch_one_task_result"]
    assert fake.op_names() == ["stream", "launch", "poll"]
    assert metrics()["rollout/arena/reward_ref_validation_success"] == 1.0


async def test_gateway_route_with_a_strict_client(fake):
    # Renewal: present once, then gone (re-registered under the same name).
    fake.script("renew", None, httpx.Response(404, json={"error": "gone"}))
    fake.on_poll = lambda f, _: (  # done once re-registered (or after about a second)
        {"status": "DONE", "score": 0.5}
        if len(f.ops("register")) >= 2 or len(f.ops("poll")) > 500
        else {"status": "RUNNING"}
    )
    agent = make_agent(fake, strict_calls=True, arena_registration_probe_interval=0.01)

    assert await asyncio.wait_for(agent.run(dict(ROW), **run_kwargs()), 5) == 0.5

    calls = agent.client.calls
    assert calls[0] == "register_llm_proxy_async" and calls[-1] == "delete_llm_proxy_async"
    assert calls.count("register_llm_proxy_async") == 2
    assert calls.count("renew_llm_proxy_async") >= 2
    assert "launch_one_task_result" in calls
    assert not fake.models  # the route was deleted
    stats = metrics()
    assert stats["rollout/arena/cleanup_success"] == 1.0
    assert stats["rollout/arena/registration_renew_success"] == 1.0


async def test_session_gateway_with_a_strict_client(fake, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(arena_routes, "time", clock)
    runtime = FakeRuntime()
    agent = make_agent(
        fake,
        strict_calls=True,
        arena_llm_route_mode="session_gateway",
        arena_registration_probe_interval=60.0,
    )
    await agent.run(dict(ROW), **run_kwargs("s-1", worker_runtime=runtime))
    fake.models.clear()  # garbage-collected: the next run probes and restores it
    clock.advance(61)
    await agent.run(dict(ROW), **run_kwargs("s-2", worker_runtime=runtime))
    runtime.destroy()  # the worker's shared route goes with it (blocking delete)

    assert agent.client.calls == [
        "register_llm_proxy_async",
        "launch_one_task_result",
        "llm_proxy_exists_async",
        "register_llm_proxy_async",
        "launch_one_task_result",
        "delete_llm_proxy",
    ]
    assert metrics()["rollout/arena/registration_restore_success"] == 1.0

    # Without a worker runtime the route is deleted when its last run ends.
    solo = make_agent(fake, strict_calls=True, arena_llm_route_mode="session_gateway")
    assert await solo.run(dict(ROW), **run_kwargs("s-3")) == 1.0
    assert solo.client.calls[-1] == "delete_llm_proxy_async" and not fake.models


# --- the rollout-only tool ---


def rollout_arenas() -> tuple[training.FakeArena, FakeArena]:
    """The dataset side (list, get, pages) and the task side of one Arena Stream."""
    dataset_side = training.FakeArena().add(
        "stream-a", 5, harness="claude-code", reward=("grader", "1")
    )
    task_side = FakeArena()
    task_side.streams["stream-a"]["default_reward_ref"] = {"key": "grader", "version": "1"}
    task_side.polls = [{"status": "RUNNING"}, {"status": "DONE", "score": 0.25}]
    return dataset_side, task_side


def test_rollout_tasks_with_a_strict_client_and_a_keyword_only_controller(monkeypatch):
    monkeypatch.delenv("ARENA_ROLLOUT_DATA_ID", raising=False)
    dataset_side, task_side = rollout_arenas()
    econfig = SWEEnvConfig(
        dataset_source="arena",
        stream_id="stream-a",
        arena_harness=HARNESS,
        arena_llm_route_mode="direct",
    )
    client = StrictCallArenaClient(inner=dataset_side.client())
    rows, stream = select_rows(econfig, 2, seed=3, client=client)
    assert client.calls == ["resolve_stream", "get_all_dataset_rows"]
    pin_streams_for_workers(econfig, [stream])
    workflow_kwargs = {"econfig": econfig, "gen_args": {}, "timeout": 30.0}
    controller = KeywordOnlyController(fake=task_side)

    completed, failed = _run_rollout_tasks(
        controller, rows, workflow_kwargs, proxy_addr=PROXY + "/"
    )

    assert failed == []
    assert completed == [(row["data_id"], 0.25) for row in rows]
    assert (
        controller.submitted
        == [{"workflow": ARENA_WORKFLOW, "group_size": 1, "proxy_addr": PROXY + "/"}] * 2
    )
    assert [c.calls for c in controller.clients] == [
        ["resolve_stream_async", "launch_one_task_result"]
    ] * 2  # the pinned grader is checked live before each launch
    launched = [c.body["data_id"] for c in task_side.ops("launch")]
    assert launched == [row["data_id"] for row in rows]


def test_registry_smoke_with_a_strict_client():
    peers = SmokePeers()
    inner = ArenaOpenAPIClient(
        base_url=training.BASE,
        api_token=training.TOKEN,
        request_retries=0,
        transport=httpx.MockTransport(peers._arena),
    )
    client = StrictCallArenaClient(inner=inner)
    with httpx.Client(transport=peers.proxy.transport) as http:
        name = registry_smoke(PROXY, ADMIN_KEY, "trial", client, http=http)
    assert client.calls == ["register_llm_proxy", "delete_llm_proxy"]
    assert peers.deleted == [f"/openapi/v1/llm/models/{name}"]


def test_rollout_only_main_with_a_keyword_only_engine(profile_env, monkeypatch):
    # The whole tool: config, a local Arena for the rows, the engine's server and proxy,
    # one agent rollout per row (strict client), the summary.
    monkeypatch.delenv("ARENA_OPENAPI_TOKEN", raising=False)
    monkeypatch.delenv("ARENA_ROLLOUT_DATA_ID", raising=False)
    task_side = FakeArena()
    task_side.streams["arith-easy"] = {
        "stream_id": "arith-easy",
        "status": "ACTIVE",
        "default_reward_ref": {"key": "exact-match", "version": "1.0.0"},
    }
    monkeypatch.setattr(KeywordOnlyEngine, "fake_for_next", task_side)
    monkeypatch.setattr(arena_rollout_only, "RemoteSGLangEngine", KeywordOnlyEngine)

    code = arena_rollout_only.main(
        [
            "--num-rollouts",
            "2",
            "--config",
            str(SWE_DIR / "arena_grpo.yaml"),
            "scheduler.type=local",
            "econfig.arena_base_url=local",
            "econfig.stream_id=arith-easy",
            "econfig.arena_llm_route_mode=direct",
        ]
    )

    assert code == 0
    engine = KeywordOnlyEngine.last
    assert engine is not None
    # no trainer: the tool bounds concurrency only, so more rollouts than a batch never hang
    assert engine.staleness is not None and engine.staleness.max_staleness is None
    assert engine.lifecycle == [
        "launch_local_server",
        "initialize 127.0.0.1:30000",
        "launch_proxy",
        "destroy",
    ]
    launches = task_side.ops("launch")
    assert len(launches) == 2 and {c.name for c in launches} == {"arith-easy"}
    assert all(c.body["base_url"] == PROXY for c in launches)
    assert (
        engine.submitted == [{"workflow": ARENA_WORKFLOW, "group_size": 1, "proxy_addr": PROXY}] * 2
    )
