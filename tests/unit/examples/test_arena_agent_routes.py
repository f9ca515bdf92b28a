"""ArenaStreamAgentWorkflow route modes (docs/arena_training.md; cases A1-A14)."""

from __future__ import annotations

import asyncio
import logging
import math
import re

import httpx
import pytest

from examples.swe import arena_routes
from examples.swe.arena_agent import (
    SESSION_REGISTRY_ATTR,
    SESSION_REGISTRY_CALLBACK_KEY,
    ArenaStreamAgentWorkflow,
)
from examples.swe.arena_client import ArenaAPIError
from tests.conftest import SECRET_SENTINEL
from tests.unit.examples.test_arena_agent_fakes import (
    ARENA_ENV,
    BASE,
    GATEWAY_KEY,
    HARNESS,
    LLM_KEY,
    PROXY,
    ROW,
    SESSION_KEY,
    FakeArena,
    FakeClock,
    FakeRuntime,
    LogRecords,
    make_agent,
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


# Probe interval of the throttling tests: long enough that the registry's background probe
# (a real asyncio.sleep of one interval) never fires during a test; the registry's clock is
# the test's, advanced by hand, so no outcome depends on how fast this machine runs.
INTERVAL = 60.0


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake_clock = FakeClock()
    monkeypatch.setattr(arena_routes, "time", fake_clock)
    return fake_clock


@pytest.fixture
def logs():
    handler = LogRecords()
    logger = logging.getLogger("areal")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


async def until(condition) -> None:
    """Yield to the event loop until ``condition()`` holds (bound it with wait_for)."""
    while not condition():
        await asyncio.sleep(0.001)


def other_tasks() -> set[asyncio.Task]:
    """Tasks on this loop besides the test's: the only code that could still call the fake."""
    return asyncio.all_tasks() - {asyncio.current_task()}


def no_run_reward_metrics(stats: dict[str, float]) -> bool:
    return not any(k.rsplit("/", 1)[-1] in ("reward", "raw_reward") for k in stats)


# --- construction ---


@pytest.mark.parametrize("interval", [0, -1, math.nan, math.inf])
def test_invalid_probe_interval_fails_before_credentials(interval):
    # A11: no ARENA_OPENAPI_* in the environment, yet the interval error comes first.
    with pytest.raises(ValueError, match="finite and positive"):
        ArenaStreamAgentWorkflow({"arena_registration_probe_interval": interval})


def test_construction_reads_timeouts_and_route_mode(fake, monkeypatch):
    agent = make_agent(fake, timeout=12.5, arena_llm_route_mode=None)
    assert agent.timeout == 12.5 and agent.route_mode == "gateway"
    assert make_agent(fake, arena_llm_route_mode="").route_mode == "gateway"
    assert make_agent(fake, arena_llm_route_mode=" direct ").route_mode == "direct"
    with pytest.raises(ValueError, match="arena_llm_route_mode"):
        make_agent(fake, arena_llm_route_mode="   ")
    with pytest.raises(ValueError, match="arena_request_timeout"):
        make_agent(fake, arena_request_timeout=0)
    with pytest.raises(ValueError, match="arena_result_dump_max_bytes"):
        make_agent(fake, arena_result_dump_max_bytes=0)
    # Without an injected client the credentials come from the environment.
    with pytest.raises(ValueError, match="ARENA_OPENAPI_BASE"):
        ArenaStreamAgentWorkflow({})
    monkeypatch.setenv("ARENA_OPENAPI_BASE", BASE + "/")
    monkeypatch.setenv("ARENA_OPENAPI_TOKEN", "tok")
    built = ArenaStreamAgentWorkflow({"arena_poll_interval": 0.5, "arena_request_retries": 1})
    assert built.client.base_url == BASE and built.client.poll_interval == 0.5
    assert built.client.timeout == 3600.0 and built.client.request_retries == 1


# --- gateway ---


async def test_gateway_registers_launches_and_deletes_the_route(fake):
    # A1
    fake.polls = [{"status": "AGENT_RUNNING"}, {"status": "OK", "score": 0.75}]
    agent = make_agent(fake, arena_task_envs={"EXTRA": "1", "API_KEY": "user-value"})

    reward = await agent.run(dict(ROW), **run_kwargs())

    assert reward == 0.75
    (register,) = fake.ops("register")
    name = register.body["model_name"]
    assert re.fullmatch(r"stream-areal-[0-9a-f]{12}", name)
    endpoint = register.body["endpoints"][0]
    assert endpoint["api_key"] == SESSION_KEY and endpoint["base_url"] == PROXY
    assert endpoint["inbound_protos"] == ["chat"]
    assert register.headers["authorization"] == f"Bearer tok-{SECRET_SENTINEL}"
    (launch,) = fake.ops("launch")
    assert launch.body["base_url"] == f"{BASE}/api" and launch.body["api_key"] == LLM_KEY
    assert launch.body["harness"] == HARNESS and launch.body["model_name"] == name
    assert launch.body["envs"] == {
        "EXTRA": "1",
        "MODEL_NAME": name,
        "BASE_URL": f"{BASE}/api",
        "API_KEY": LLM_KEY,
    }
    assert len(fake.ops("poll")) == 2
    assert [c.name for c in fake.ops("delete")] == [name]
    assert fake.op_names()[-1] == "delete" and not fake.models
    stats = metrics()
    for key in ("call", "registration", "launch", "terminal", "cleanup"):
        assert stats[f"rollout/arena/{key}_success"] == 1.0, key
    assert stats["rollout/arena/call_success__count"] == 1
    assert no_run_reward_metrics(stats)


async def test_gateway_without_llm_key_still_deletes_the_route(fake):
    agent = make_agent(fake, llm_key="")
    with pytest.raises(ValueError, match="ARENA_LLM_API_KEY"):
        await agent.run(dict(ROW), **run_kwargs())
    assert fake.op_names() == ["register", "delete"]
    stats = metrics()
    assert stats["rollout/arena/registration_success"] == 1.0
    assert "rollout/arena/call_success" not in stats


async def test_gateway_renewal_reregisters_only_when_absent_and_survives_errors(fake):
    # renew (present) -> renew (transient error) -> renew (404: re-register).
    fake.script(
        "renew",
        None,
        httpx.Response(500, json={"error": "flaky"}),
        httpx.Response(404, json={"error": "gone"}),
    )
    fake.on_poll = lambda f, _: (
        {"status": "DONE", "score": 1.0} if len(f.ops("register")) >= 2 else {"status": "RUNNING"}
    )
    agent = make_agent(fake, arena_registration_probe_interval=0.01)

    assert await asyncio.wait_for(agent.run(dict(ROW), **run_kwargs()), 5) == 1.0

    sequence = [op for op in fake.op_names() if op in ("register", "renew")]
    assert sequence[:5] == ["register", "renew", "renew", "renew", "register"]
    first, again = fake.ops("register")
    assert again.body == first.body  # same name, deployment id, upstream URL and key
    stats = metrics()
    assert stats["rollout/arena/registration_renew_success__count"] >= 3
    assert stats["rollout/arena/registration_renew_success"] < 1.0
    # The loop is stopped before the final DELETE and never renews afterwards.
    assert fake.op_names()[-1] == "delete"
    assert not other_tasks()  # nothing left on the loop that could renew


async def test_gateway_renewal_stops_when_the_rollout_is_cancelled(fake):
    fake.polls = [{"status": "RUNNING"}]
    agent = make_agent(fake, arena_registration_probe_interval=0.01)
    task = asyncio.create_task(agent.run(dict(ROW), **run_kwargs()))
    await asyncio.wait_for(until(lambda: len(fake.ops("renew")) >= 2), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fake.op_names()[-1] == "delete" and not fake.models
    assert not other_tasks()  # nothing left on the loop that could renew


# --- direct ---


async def test_direct_launches_at_the_proxy_without_registration(fake):
    # A2
    agent = make_agent(
        fake,
        arena_llm_route_mode="direct",
        arena_task_envs={"ANTHROPIC_BASE_URL": "http://elsewhere", "KEEP": "me"},
    )
    assert await agent.run(dict(ROW), **run_kwargs(base_url=PROXY + "/")) == 1.0

    assert fake.op_names() == ["launch", "poll"]
    (launch,) = fake.ops("launch")
    body = launch.body
    assert body["session_id"] == "sess-1" and body["base_url"] == PROXY
    assert body["api_key"] == SESSION_KEY
    assert re.fullmatch(r"stream-areal-[0-9a-f]{12}", body["model_name"])
    envs = body["envs"]
    assert envs["ANTHROPIC_BASE_URL"] == envs["OPENAI_BASE_URL"] == PROXY
    assert envs["ANTHROPIC_API_KEY"] == envs["OPENAI_API_KEY"] == SESSION_KEY
    assert envs["NO_PROXY"] == envs["no_proxy"] == "rollout-proxy"
    assert envs["KEEP"] == "me"
    stats = metrics()
    assert stats["rollout/arena/direct_route"] == 1.0
    assert not any("registration" in k or "cleanup" in k for k in stats)


@pytest.mark.parametrize(
    "envs, expected",
    [
        ({"NO_PROXY": " localhost , "}, "localhost,rollout-proxy"),
        ({"no_proxy": "localhost,rollout-proxy"}, "localhost,rollout-proxy"),
        ({"NO_PROXY": "", "no_proxy": "10.0.0.1"}, "10.0.0.1,rollout-proxy"),
    ],
)
async def test_direct_keeps_configured_no_proxy_hosts(fake, envs, expected):
    # A3: the proxy host is appended once, without its port.
    agent = make_agent(fake, arena_llm_route_mode="direct", arena_task_envs=envs)
    await agent.run(dict(ROW), **run_kwargs())
    (launch,) = fake.ops("launch")
    assert launch.body["envs"]["NO_PROXY"] == launch.body["envs"]["no_proxy"] == expected


@pytest.mark.parametrize("mode", ["direct", "session_gateway"])
@pytest.mark.parametrize("session", [None, "", "-starts-badly", "a" * 201, "has space"])
async def test_direct_and_session_gateway_need_a_valid_session_id(fake, mode, session):
    # A4
    agent = make_agent(fake, arena_llm_route_mode=mode)
    kwargs = run_kwargs()
    kwargs["session_id"] = session
    with pytest.raises(ValueError, match="session_id is required"):
        await agent.run(dict(ROW), **kwargs)
    assert fake.calls == []


# --- session gateway ---


async def test_session_gateway_shares_one_route_between_concurrent_sessions(fake):
    # A5
    fake.on_poll = lambda f, _: (
        {"status": "DONE", "score": 1.0} if len(f.ops("launch")) == 2 else {"status": "RUNNING"}
    )
    agent = make_agent(
        fake,
        arena_llm_route_mode="session_gateway",
        arena_task_envs={"ANTHROPIC_CUSTOM_HEADERS": " X-Team: rl \n"},
    )
    rewards = await asyncio.wait_for(
        asyncio.gather(
            agent.run(dict(ROW), **run_kwargs("s-1")), agent.run(dict(ROW), **run_kwargs("s-2"))
        ),
        5,
    )

    assert rewards == [1.0, 1.0]
    (register,) = fake.ops("register")
    name = register.body["model_name"]
    suffix = re.fullmatch(r"stream-areal-session-([0-9a-f]{16})", name).group(1)
    endpoint = register.body["endpoints"][0]
    assert endpoint["endpoint_id"] == f"session-{suffix}"
    assert endpoint["api_key"] == GATEWAY_KEY and endpoint["base_url"] == PROXY
    launches = fake.ops("launch")
    assert sorted(c.body["session_id"] for c in launches) == ["s-1", "s-2"]
    for launch in launches:
        session = launch.body["session_id"]
        assert launch.body["model_name"] == name
        assert launch.body["base_url"] == f"{BASE}/api" and launch.body["api_key"] == LLM_KEY
        assert launch.body["envs"]["ANTHROPIC_CUSTOM_HEADERS"] == (
            f"X-Team: rl\nX-Session-Id: {session}\nX-Session-Token: st-{session}-{SECRET_SENTINEL}"
        )
    assert [c.name for c in fake.ops("delete")] == [name]
    assert fake.op_names()[-1] == "delete"  # after both tasks finished
    stats = metrics()
    assert stats["rollout/arena/session_gateway_route"] == 1.0
    assert stats["rollout/arena/session_gateway_route__count"] == 2
    assert stats["rollout/arena/registration_success__count"] == 1


async def test_worker_runtime_keeps_one_route_for_every_workflow_object(fake):
    # A6
    runtime = FakeRuntime()
    first = make_agent(fake, arena_llm_route_mode="session_gateway")
    second = make_agent(fake, arena_llm_route_mode="session_gateway")
    await first.run(dict(ROW), **run_kwargs("s-1", worker_runtime=runtime))
    await second.run(dict(ROW), **run_kwargs("s-2", worker_runtime=runtime))

    assert len(fake.ops("register")) == 1 and fake.ops("delete") == []
    assert list(runtime.callbacks) == [SESSION_REGISTRY_CALLBACK_KEY]
    assert runtime.registrations == 2  # offered on every run, kept once
    name = fake.ops("register")[0].body["model_name"]

    runtime.destroy()  # synchronous: the route is gone when destroy returns
    assert [c.name for c in fake.ops("delete")] == [name]
    with pytest.raises(RuntimeError, match="closed"):
        await first.run(dict(ROW), **run_kwargs("s-3", worker_runtime=runtime))


async def test_worker_runtime_contract_violations_are_type_errors(fake):
    agent = make_agent(fake, arena_llm_route_mode="session_gateway")
    with pytest.raises(TypeError, match="register_destroy_callback"):
        await agent.run(dict(ROW), **run_kwargs(worker_runtime=object()))
    runtime = FakeRuntime()
    setattr(runtime, SESSION_REGISTRY_ATTR, {"not": "a registry"})
    with pytest.raises(TypeError, match="registry"):
        await agent.run(dict(ROW), **run_kwargs(worker_runtime=runtime))
    assert fake.calls == []


async def test_changed_gateway_key_within_a_worker_is_refused(fake):
    runtime = FakeRuntime()
    agent = make_agent(fake, arena_llm_route_mode="session_gateway")
    await agent.run(dict(ROW), **run_kwargs(worker_runtime=runtime))
    with pytest.raises(RuntimeError, match="gateway key changed"):
        await agent.run(
            dict(ROW), **run_kwargs(worker_runtime=runtime, proxy_gateway_api_key="gw-other")
        )
    assert len(fake.ops("launch")) == 1


async def test_garbage_collected_route_is_restored_before_the_next_launch(fake, clock):
    # A7
    runtime = FakeRuntime()
    agent = make_agent(
        fake, arena_llm_route_mode="session_gateway", arena_registration_probe_interval=INTERVAL
    )
    await agent.run(dict(ROW), **run_kwargs("s-1", worker_runtime=runtime))
    fake.models.clear()  # Arena garbage-collects the idle route
    clock.advance(INTERVAL - 1)
    start = len(fake.calls)
    await agent.run(dict(ROW), **run_kwargs("s-2", worker_runtime=runtime))
    assert fake.op_names()[start:] == ["launch", "poll"]  # within the interval: no probe

    clock.advance(1)  # the interval has elapsed
    start = len(fake.calls)
    await agent.run(dict(ROW), **run_kwargs("s-3", worker_runtime=runtime))

    assert fake.op_names()[start:] == ["exists", "register", "launch", "poll"]
    first, restored = fake.ops("register")
    assert restored.body == first.body  # same name and deployment id
    stats = metrics()
    assert stats["rollout/arena/registration_present"] == 0.0
    assert stats["rollout/arena/registration_restore_success"] == 1.0


async def test_concurrent_acquires_share_a_single_probe(fake, clock):
    # A8
    runtime = FakeRuntime()
    fake.launch_payload = {"status": "DONE", "score": 1.0}
    agent = make_agent(
        fake, arena_llm_route_mode="session_gateway", arena_registration_probe_interval=INTERVAL
    )
    await agent.run(dict(ROW), **run_kwargs("s-0", worker_runtime=runtime))
    clock.advance(INTERVAL + 1)

    runs = [agent.run(dict(ROW), **run_kwargs(f"s-{i}", worker_runtime=runtime)) for i in range(32)]
    assert await asyncio.gather(*runs) == [1.0] * 32

    assert len(fake.ops("exists")) == 1
    assert len(fake.ops("register")) == 1
    assert len(fake.ops("launch")) == 33


async def test_slow_failing_probe_throttles_from_its_completion(fake, clock):
    # A9: the probe takes longer than the interval; the next task still uses the cache.
    def slow_failure(request):
        clock.advance(1.5 * INTERVAL)  # the probe's duration
        return httpx.Response(503, json={"error": "busy"})

    runtime = FakeRuntime()
    fake.launch_payload = {"status": "DONE", "score": 1.0}
    agent = make_agent(
        fake, arena_llm_route_mode="session_gateway", arena_registration_probe_interval=INTERVAL
    )
    await agent.run(dict(ROW), **run_kwargs("s-1", worker_runtime=runtime))
    clock.advance(INTERVAL + 1)
    fake.script("exists", slow_failure)

    await agent.run(dict(ROW), **run_kwargs("s-2", worker_runtime=runtime))
    # 1.5 intervals after the probe started, but none after it completed: no new probe.
    await agent.run(dict(ROW), **run_kwargs("s-3", worker_runtime=runtime))

    assert len(fake.ops("exists")) == 1
    assert len(fake.ops("launch")) == 3 and len(fake.ops("register")) == 1
    assert metrics()["rollout/arena/registration_probe_success"] == 0.0


async def test_failed_restore_raises_then_throttles_retries(fake, clock):
    # A10
    runtime = FakeRuntime()
    fake.launch_payload = {"status": "DONE", "score": 1.0}
    agent = make_agent(
        fake, arena_llm_route_mode="session_gateway", arena_registration_probe_interval=INTERVAL
    )
    await agent.run(dict(ROW), **run_kwargs("s-1", worker_runtime=runtime))
    fake.models.clear()
    fake.script("register", httpx.Response(400, json={"error": "quota"}))
    clock.advance(INTERVAL + 1)

    with pytest.raises(ArenaAPIError, match="HTTP 400"):
        await agent.run(dict(ROW), **run_kwargs("s-2", worker_runtime=runtime))
    clock.advance(INTERVAL - 1)  # still within the interval after the failed restore
    with pytest.raises(ArenaAPIError, match="restore retries are throttled"):
        await agent.run(dict(ROW), **run_kwargs("s-3", worker_runtime=runtime))

    assert len(fake.ops("launch")) == 1
    assert len(fake.ops("exists")) == 2  # the liveness probe and the post-failure re-check
    assert len(fake.ops("register")) == 2  # the first registration and one restore
    stats = metrics()
    assert stats["rollout/arena/registration_restore_success"] == 0.0
    # Only the healthy first run reached a launch; restore failures record no call outcome.
    assert stats["rollout/arena/call_success"] == 1.0
    assert stats["rollout/arena/call_success__count"] == 1


async def test_background_probe_restores_a_route_collected_while_a_task_waits(fake):
    # A12
    fake.on_launch = lambda f, body: f.models.clear()
    fake.on_poll = lambda f, _: (
        {"status": "DONE", "score": 1.0} if len(f.ops("register")) >= 2 else {"status": "QUEUED"}
    )
    agent = make_agent(
        fake, arena_llm_route_mode="session_gateway", arena_registration_probe_interval=0.03
    )

    assert await asyncio.wait_for(agent.run(dict(ROW), **run_kwargs()), 5) == 1.0

    first, restored = fake.ops("register")
    assert restored.body["model_name"] == first.body["model_name"]
    assert restored.body["endpoints"][0]["endpoint_id"] == first.body["endpoints"][0]["endpoint_id"]
    assert fake.op_names().index("register", 1) < fake.op_names().index("delete")
    assert metrics()["rollout/arena/registration_restore_success"] == 1.0


async def test_lost_registration_response_deletes_the_exact_name(fake):
    # A13
    fake.script("register", httpx.ReadTimeout("response lost"))
    agent = make_agent(fake, arena_llm_route_mode="session_gateway", arena_request_retries=0)

    with pytest.raises(ArenaAPIError, match="request failed"):
        await agent.run(dict(ROW), **run_kwargs())

    (register,) = fake.ops("register")
    assert [c.name for c in fake.ops("delete")] == [register.body["model_name"]]
    assert fake.ops("launch") == []
    stats = metrics()
    assert stats["rollout/arena/registration_success"] == 0.0
    assert stats["rollout/arena/call_success"] == 0.0
    assert stats["rollout/arena/cleanup_success"] == 1.0


@pytest.mark.parametrize("missing", ["proxy_gateway_api_key", "proxy_session_token"])
async def test_session_gateway_needs_the_gateway_key_and_token(fake, missing):
    # A14
    agent = make_agent(fake, arena_llm_route_mode="session_gateway")
    kwargs = run_kwargs()
    kwargs[missing] = ""
    with pytest.raises(ValueError, match="proxy_gateway_api_key and proxy_session_token"):
        await agent.run(dict(ROW), **kwargs)
    assert fake.calls == []


# --- secrets ---


async def test_secrets_stay_out_of_logs_and_errors(fake, logs):
    errors: list[BaseException] = []
    fake.script("renew", httpx.Response(500, text=f"echo {SESSION_KEY}"))
    fake.script("delete", httpx.Response(500, text=f"echo {LLM_KEY} {GATEWAY_KEY}"))
    fake.on_poll = lambda f, _: (
        {"status": "DONE", "score": 1.0} if f.ops("renew") else {"status": "RUNNING"}
    )
    agent = make_agent(fake, arena_registration_probe_interval=0.01)
    await asyncio.wait_for(agent.run(dict(ROW), **run_kwargs()), 5)

    timeout_agent = make_agent(fake, arena_llm_route_mode="session_gateway", timeout=0.05)
    fake.on_poll = None
    fake.polls = [{"status": "RUNNING"}]
    try:
        await timeout_agent.run(dict(ROW), **run_kwargs())
    except TimeoutError as e:
        errors.append(e)
    fake.script("register", httpx.Response(400, text=f"bad key {GATEWAY_KEY}"))
    try:
        await make_agent(fake, arena_llm_route_mode="session_gateway").run(
            dict(ROW), **run_kwargs("s-9")
        )
    except ArenaAPIError as e:
        errors.append(e)

    assert len(errors) == 2 and logs.messages(logging.WARNING)
    for text in [*logs.messages(), *map(str, errors)]:
        assert SECRET_SENTINEL not in text, text
