"""The Arena client against the real local Arena server, and tasks through its gateway.

The upstream behind every registered route is a stub chat-completions server that
answers each arithmetic prompt of the default catalog with its correct answer (or a
scripted wrong one), so a graded score is known in advance.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from areal.utils.network import find_free_port, wait_healthy
from areal.utils.serving import serve_in_thread
from examples.swe.arena_client import ArenaAPIError, ArenaOpenAPIClient, ArenaTaskFailedError
from examples.swe.local_arena.catalog import DEFAULT_CATALOG, load_catalog
from examples.swe.local_arena.testing import running_local_arena
from tests.fakes.stub_llm import StubLLM, last_user_text

REPO = Path(__file__).resolve().parents[2]
STREAM = "arith-easy"
SESSION_HEADERS = "X-Session-Id: sess-42\nX-Session-Token: st-token-42"
UPSTREAM_KEY = "upstream-key-for-tests"


@pytest.fixture(scope="module")
def catalog():
    return load_catalog(DEFAULT_CATALOG)


@pytest.fixture(scope="module")
def answers(catalog) -> dict[str, str]:
    """Prompt -> correct answer, for the arithmetic Stream."""
    return {row.prompt: str(row.grading["answer"]) for row in catalog.rows(STREAM)}


def correct(answers: dict[str, str]):
    def reply(body: dict) -> str:
        text = last_user_text(body)
        for prompt, answer in answers.items():
            if prompt in text:
                return f"The answer is {answer}."
        return "I do not know."

    return reply


@pytest.fixture
def stub(answers):
    llm = StubLLM(correct(answers))
    with serve_in_thread(llm.app()) as url:
        llm.url = url
        yield llm


@pytest.fixture(params=["plain", "wrapped"])
def arena(request, tmp_path):
    with running_local_arena(tmp_path, envelope=request.param, task_timeout=30) as handle:
        yield handle


@pytest.fixture
def plain_arena(tmp_path):
    with running_local_arena(tmp_path, task_timeout=30) as handle:
        yield handle


def client_for(arena, **options) -> ArenaOpenAPIClient:
    options.setdefault("poll_interval", 0.05)
    return ArenaOpenAPIClient(
        base_url=arena.base_url, api_token=arena.token, llm_api_key=arena.token, **options
    )


def route_name() -> str:
    return f"stream-areal-{uuid.uuid4().hex[:12]}"


async def register(client: ArenaOpenAPIClient, stub, name: str | None = None) -> tuple[str, str]:
    return await client.register_llm_proxy_async(
        name or route_name(), stub.url, UPSTREAM_KEY, str(uuid.uuid4())
    )


# --- the client's suite against the real server ---


async def test_discovery_streams_and_harnesses(arena, catalog):
    client = client_for(arena)
    active = {s["stream_id"] for s in client.list_streams()}
    everything = {s["stream_id"] for s in client.list_streams(status=None)}
    expected_active = {sid for sid, s in catalog.streams.items() if s.status == "ACTIVE"}
    assert active == expected_active and STREAM in active
    assert everything == set(catalog.streams)
    stream = await client.resolve_stream_async(STREAM)
    spec = catalog.streams[STREAM]
    assert stream["default_reward_ref"] == spec.default_reward.to_json()
    assert stream["default_harness_ref"] == spec.default_harness.to_json()
    assert client.resolve_stream_id("") in expected_active
    for sid, spec in catalog.streams.items():
        if spec.status != "ACTIVE":
            with pytest.raises(ArenaAPIError, match="ACTIVE"):
                client.resolve_stream(sid)
    with pytest.raises(ArenaAPIError, match="HTTP 404"):
        client.resolve_stream("no-such-stream")
    ref = spec.default_harness
    harness = client.get_harness_version(ref.key, ref.version)
    assert (harness.get("data") or harness)["status"] == "PUBLISHED"
    client.close()


async def test_dataset_rows_match_the_catalog(arena, catalog):
    client = client_for(arena)
    rows = await client.get_all_dataset_rows_async(STREAM)
    assert [r["data_id"] for r in rows] == [row.data_id for row in catalog.rows(STREAM)]
    assert {r["arena_task_type"] for r in rows} == {"math"}
    assert {r["stream_id"] for r in rows} == {STREAM}
    await client.aclose()


def test_pagination_over_a_thousand_rows(tmp_path):
    catalog_file = write_big_catalog(tmp_path, rows=1205)
    with running_local_arena(tmp_path, catalog_file) as arena:
        client = client_for(arena)
        rows = client.get_all_dataset_rows("big")
        client.close()
    assert [r["data_id"] for r in rows] == [f"q{i:05d}" for i in range(1205)]


async def test_route_register_exists_renew_delete(arena, stub):
    client = client_for(arena)
    name = route_name()
    gateway, registered = await register(client, stub, name)
    assert registered == name and gateway == f"{arena.base_url}/api"
    assert await client.llm_proxy_exists_async(name)
    assert await client.renew_llm_proxy_async(name)
    shown = httpx.get(
        f"{arena.base_url}/openapi/v1/llm/models/{name}",
        headers={"Authorization": f"Bearer {arena.token}"},
    )
    assert UPSTREAM_KEY not in shown.text  # the upstream key is never echoed
    await client.delete_llm_proxy_async(name)
    assert not await client.llm_proxy_exists_async(name)
    assert not await client.renew_llm_proxy_async(name)
    await client.delete_llm_proxy_async(name)  # deleting an absent route is fine
    await client.aclose()


async def test_launch_and_poll_to_done_with_a_graded_score(arena, stub, catalog):
    client = client_for(arena)
    gateway, name = await register(client, stub)
    row = catalog.rows(STREAM)[0]
    result = await client.launch_one_task_result(STREAM, row.data_id, name, gateway, arena.token)
    assert result.status == "DONE" and result.score == 1.0
    assert str(row.grading["answer"]) in result.raw["answer"]
    assert result.artifacts_uri.startswith("file://") and result.trace_id
    assert result.computed_at
    # the wrong answer is graded 0, still DONE
    stub.reply = lambda body: "The answer is 123456789."
    wrong = await client.launch_one_task_result(STREAM, row.data_id, name, gateway, arena.token)
    assert wrong.status == "DONE" and wrong.score == 0.0
    # the Stream's task list (E10) shows both, newest first, with provenance
    listed = await client.list_stream_tasks_async(STREAM)
    listed = listed if isinstance(listed, list) else listed["items"]  # the two envelopes
    assert [t["task_id"] for t in listed[:2]] == [wrong.task_id, result.task_id]
    assert listed[0]["harness_ref"] == catalog.streams[STREAM].default_harness.to_json()
    await client.aclose()


# --- the gateway, one harness per protocol ---


@pytest.mark.parametrize(
    "harness", ["answer-chat@1.0.0", "answer-responses@1.0.0", "answer-anthropic@1.0.0"]
)
async def test_builtin_harness_through_the_gateway(plain_arena, stub, catalog, harness):
    arena = plain_arena
    client = client_for(arena)
    gateway, name = await register(client, stub)
    row = catalog.rows(STREAM)[1]
    result = await client.launch_one_task_result(
        STREAM,
        row.data_id,
        name,
        gateway,
        arena.token,
        session_id="sess-42",
        harness=harness,
        task_envs={"ANTHROPIC_CUSTOM_HEADERS": SESSION_HEADERS},
    )
    assert result.status == "DONE" and result.score == 1.0, result.raw
    assert stub.calls, "the upstream saw no call"
    for call in stub.calls:
        assert call.path.endswith("/chat/completions")
        assert isinstance(call.body["messages"], list) and not call.body.get("stream")
        assert call.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
        assert call.headers["x-session-id"] == "sess-42"
        assert call.headers["x-session-token"] == "st-token-42"
    await client.aclose()


def test_gateway_rejects_unknown_models_and_bad_keys(plain_arena):
    arena = plain_arena
    auth = {"Authorization": f"Bearer {arena.token}"}
    chat = {"model": "stream-areal-missing", "messages": [{"role": "user", "content": "hi"}]}
    missing = httpx.post(f"{arena.gateway_url}/v1/chat/completions", headers=auth, json=chat)
    assert missing.status_code == 404 and "not registered" in missing.json()["error"]["message"]
    anthropic = httpx.post(
        f"{arena.gateway_url}/v1/messages",
        headers={"x-api-key": arena.token},
        json={**chat, "max_tokens": 8},
    )
    assert anthropic.status_code == 404 and anthropic.json()["type"] == "error"
    wrong = httpx.post(
        f"{arena.gateway_url}/v1/chat/completions",
        headers={"Authorization": "Bearer nope"},
        json=chat,
    )
    assert wrong.status_code == 401
    assert httpx.head(f"{arena.gateway_url}").status_code == 200  # Claude Code's preflight


# --- the real agent CLIs through the gateway ---


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["claude-code", "codex"])
async def test_real_cli_harness_through_the_gateway(plain_arena, stub, catalog, kind):
    from examples.swe.local_arena.harnesses import cli_available

    if cli_available(kind) is None:
        pytest.skip(f"the {kind} CLI is not installed; run `make agent-clis`")
    arena = plain_arena
    client = client_for(arena)
    gateway, name = await register(client, stub)
    row = catalog.rows(STREAM)[2]
    harness = next(str(h.ref) for h in catalog.harnesses.values() if h.kind == kind)
    version = harness.replace("@*", "@0.0.0-local")  # a `*` entry serves any pinned version
    result = await asyncio.wait_for(
        client.launch_one_task_result(
            STREAM,
            row.data_id,
            name,
            gateway,
            arena.token,
            session_id="sess-42",
            harness=version,
            task_envs={"ANTHROPIC_CUSTOM_HEADERS": SESSION_HEADERS},
        ),
        timeout=180,
    )
    assert result.status == "DONE", result.raw
    assert result.score == 1.0, result.raw
    assert stub.calls, "the CLI never reached the upstream through the gateway"
    for call in stub.calls:
        assert call.headers["x-session-id"] == "sess-42"
        assert call.headers["x-session-token"] == "st-token-42"
    await client.aclose()


# --- statuses ---


async def test_harness_failures_map_to_task_statuses(tmp_path, answers):
    llm = StubLLM(correct(answers))
    with (
        serve_in_thread(llm.app()) as url,
        running_local_arena(tmp_path, task_timeout=1.0) as arena,
    ):
        llm.url = url
        client = client_for(arena)
        gateway, name = await register(client, llm)
        data_id = next(iter(load_catalog(DEFAULT_CATALOG).rows(STREAM))).data_id

        async def outcome() -> ArenaTaskFailedError:
            with pytest.raises(ArenaTaskFailedError) as failed:
                await client.launch_one_task_result(STREAM, data_id, name, gateway, arena.token)
            return failed.value

        llm.status = 500
        harness_failed = await outcome()
        assert harness_failed.status == "HARNESS_FAILED"
        assert harness_failed.result.raw["error"]
        assert arena.token not in str(harness_failed.result.raw)
        llm.status, llm.reply = 200, lambda body: ""
        assert (await outcome()).status == "NO_OUTPUT"
        llm.reply, llm.delay = correct(answers), 5.0
        assert (await outcome()).status == "TIMEOUT"
        llm.delay = 0.0
        arena.set_faults(force_status={data_id: "COLLECT_FAILED"})
        forced = await outcome()
        assert forced.status == "COLLECT_FAILED" and "fault injection" in forced.result.raw["error"]
        # the harness runs (its LLM calls happen), then fails as a Claude Code agent phase
        calls_before = len(llm.calls)
        arena.set_faults(fail_after_harness={data_id: "HARNESS_FAILED"})
        after = await outcome()
        assert after.status == "HARNESS_FAILED" and len(llm.calls) > calls_before
        error = after.result.raw["error"].lower()
        assert "harness: harness agent phase exited with code" in error
        assert "harness: agent phase error: claude reported error" in error
        await client.aclose()


async def test_grader_crash_is_eval_failed(plain_arena, stub, catalog, monkeypatch):
    from examples.swe.local_arena import graders
    from examples.swe.local_arena.types import GraderError

    def broken(reward, row, answer):
        raise GraderError("the grader's interpreter would not start")

    monkeypatch.setattr(graders, "grade", broken)
    client = client_for(plain_arena)
    gateway, name = await register(client, stub)
    data_id = catalog.rows(STREAM)[0].data_id
    with pytest.raises(ArenaTaskFailedError) as failed:
        await client.launch_one_task_result(STREAM, data_id, name, gateway, plain_arena.token)
    assert failed.value.status == "EVAL_FAILED"
    assert "would not start" in failed.value.result.raw["error"]
    assert failed.value.result.raw["answer"]  # the harness output is kept for debugging
    await client.aclose()


# --- faults ---


async def test_injected_transient_errors_are_retried_by_the_client(plain_arena, stub):
    arena = plain_arena
    arena.set_faults(
        error_rates={"429": 0.2, "500": 0.2, "403_marker": 0.15, "302_fromspanner": 0.15}, seed=3
    )
    statuses = {
        httpx.get(
            f"{arena.base_url}/openapi/v1/streams",
            headers={"Authorization": f"Bearer {arena.token}"},
        ).status_code
        for _ in range(60)
    }
    assert {200, 302, 403, 429, 500} <= statuses

    async def no_wait(seconds: float) -> None:
        return None

    client = client_for(arena, request_retries=30, async_sleep=no_wait, sleep=lambda s: None)
    assert STREAM in {s["stream_id"] for s in await client.list_streams_async()}
    rows = await client.get_all_dataset_rows_async(STREAM)
    assert len(rows) == len(load_catalog(DEFAULT_CATALOG).rows(STREAM))
    _, name = await register(client, stub)
    assert await client.llm_proxy_exists_async(name)
    await client.aclose()


async def test_route_garbage_collection_and_reregistration(plain_arena, stub, catalog):
    arena = plain_arena
    client = client_for(arena)
    name = route_name()
    await register(client, stub, name)
    arena.set_faults(route_ttl_seconds=0.3)
    deadline = time.monotonic() + 30  # collected once 0.3 s pass without a renewal
    while await client.llm_proxy_exists_async(name):
        assert time.monotonic() < deadline, "the expired route was never collected"
        await asyncio.sleep(0.05)
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    auth = {"Authorization": f"Bearer {arena.token}"}
    gone = httpx.post(f"{arena.gateway_url}/v1/chat/completions", headers=auth, json=chat)
    assert gone.status_code == 404
    # re-registered under the same name, as the session-gateway registry does
    arena.set_faults()
    await register(client, stub, name)
    assert await client.llm_proxy_exists_async(name)
    back = httpx.post(f"{arena.gateway_url}/v1/chat/completions", headers=auth, json=chat)
    assert back.status_code == 200
    await client.aclose()


# --- bad input ---


def test_bad_input_gets_clear_4xx_bodies(plain_arena, catalog):
    arena = plain_arena
    api = f"{arena.base_url}/openapi/v1"
    auth = {"Authorization": f"Bearer {arena.token}"}
    data_id = catalog.rows(STREAM)[0].data_id
    launch = {
        "data_id": data_id,
        "model_name": "stream-areal-x",
        "base_url": "http://127.0.0.1:9",
        "api_key": "k",
    }

    def check(response: httpx.Response, status: int, phrase: str) -> None:
        assert response.status_code == status, response.text
        assert phrase in response.json()["error"]["message"], response.text

    check(httpx.get(f"{api}/streams"), 401, "missing bearer token")
    check(httpx.get(f"{api}/streams", headers={"Authorization": "Bearer wrong"}), 403, "token")
    check(
        httpx.post(
            f"{api}/streams/{STREAM}/launch_one_task",
            headers={**auth, "Content-Type": "application/json"},
            content=b"{not json",
        ),
        400,
        "not valid JSON",
    )
    check(
        httpx.post(f"{api}/streams/no-such/launch_one_task", headers=auth, json=launch),
        404,
        "no Stream",
    )
    check(
        httpx.post(
            f"{api}/streams/{STREAM}/launch_one_task",
            headers=auth,
            json={**launch, "data_id": "missing"},
        ),
        404,
        "no data_id",
    )
    check(
        httpx.post(
            f"{api}/streams/{STREAM}/launch_one_task",
            headers=auth,
            json={k: v for k, v in launch.items() if k != "model_name"},
        ),
        400,
        "model_name",
    )
    drafts = [h for h in catalog.harnesses.values() if h.status == "DRAFT"]
    assert drafts, "the default catalog should carry a DRAFT harness"
    check(
        httpx.post(
            f"{api}/streams/{STREAM}/launch_one_task",
            headers=auth,
            json={**launch, "harness": str(drafts[0].ref)},
        ),
        409,
        "not PUBLISHED",
    )
    paused = [sid for sid, s in catalog.streams.items() if s.status != "ACTIVE"]
    if paused:
        check(
            httpx.post(f"{api}/streams/{paused[0]}/launch_one_task", headers=auth, json=launch),
            409,
            "not ACTIVE",
        )
    check(
        httpx.post(f"{api}/llm/models", headers=auth, json={"model_name": "stream-areal-y"}),
        400,
        "endpoints",
    )
    check(
        httpx.post(f"{api}/streams/{STREAM}/dataset?limit=5000", headers=auth),
        400,
        "limit",
    )
    assert httpx.get(f"{arena.base_url}/health").json()["status"] == "ok"


# --- restart ---


def test_restart_keeps_results_and_fails_the_interrupted_task(tmp_path, answers):
    fast, slow = StubLLM(correct(answers)), StubLLM(correct(answers), delay=60.0)
    db, token_file = tmp_path / "arena.db", tmp_path / "token"
    with serve_in_thread(fast.app()) as fast_url, serve_in_thread(slow.app()) as slow_url:
        fast.url, slow.url = fast_url, slow_url
        server, port = start_server(db, token_file)
        token = token_file.read_text().strip()
        arena = type("Handle", (), {"base_url": f"http://127.0.0.1:{port}", "token": token})
        client = client_for(arena)
        rows = load_catalog(DEFAULT_CATALOG).rows(STREAM)
        try:
            gateway, fast_route = asyncio.run(register(client, fast))
            _, slow_route = asyncio.run(register(client, slow))
            done = asyncio.run(
                client.launch_one_task_result(STREAM, rows[0].data_id, fast_route, gateway, token)
            )
            assert done.status == "DONE"
            interrupted = launch_raw(arena, rows[1].data_id, slow_route, gateway)
            wait_for(lambda: slow.calls, "the slow task to reach its upstream")
            server.send_signal(signal.SIGKILL)
            server.wait(timeout=30)
            server, port = start_server(db, token_file, port)
            after = httpx.get(
                f"http://127.0.0.1:{port}/openapi/v1/tasks/{done.task_id}/result",
                headers={"Authorization": f"Bearer {token}"},
            ).json()
            assert after["status"] == "DONE" and after["score"] == done.score
            lost = httpx.get(
                f"http://127.0.0.1:{port}/openapi/v1/tasks/{interrupted}/result",
                headers={"Authorization": f"Bearer {token}"},
            ).json()
            assert lost["status"] == "SETUP_FAILED" and "stopped" in lost["raw"]["error"]
            # routes survive the restart too
            assert asyncio.run(client.llm_proxy_exists_async(fast_route))
        finally:
            slow.delay = 0.0
            server.kill()
            server.wait(timeout=30)
            client.close()


# --- helpers ---


def start_server(db: Path, token_file: Path, port: int | None = None):
    port = port or find_free_port("127.0.0.1")
    argv = [
        sys.executable, "-m", "examples.swe.local_arena", "serve", "--port", str(port),
        "--db", str(db), "--token-file", str(token_file), "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(argv, cwd=REPO, env=env)
    wait_healthy(f"127.0.0.1:{port}", process, timeout=60, what="local Arena")
    return process, port


def launch_raw(arena, data_id: str, route: str, gateway: str) -> str:
    response = httpx.post(
        f"{arena.base_url}/openapi/v1/streams/{STREAM}/launch_one_task",
        headers={"Authorization": f"Bearer {arena.token}"},
        json={"data_id": data_id, "model_name": route, "base_url": gateway, "api_key": arena.token},
    )
    response.raise_for_status()
    return response.json()["task_id"]


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def write_big_catalog(directory: Path, rows: int, grading: dict | None = None) -> Path:
    """A one-Stream catalog (``big``) with ``rows`` arithmetic rows."""
    import json

    data = directory / "big.jsonl"
    with data.open("w") as f:
        for i in range(rows):
            row = {
                "data_id": f"q{i:05d}",
                "prompt": f"What is {i} + 1?",
                "grading": grading if grading is not None else {"answer": str(i + 1)},
                "tags": ["domain:math"],
            }
            f.write(json.dumps(row) + "\n")
    catalog = directory / "big.yaml"
    catalog.write_text(
        f"""
streams:
  - stream_id: big
    status: ACTIVE
    default_harness: answer-chat@1.0.0
    default_reward: exact-match@1.0.0
    dataset: big
    tags: ["domain:math"]
harnesses:
  - key: answer-chat
    version: 1.0.0
    status: PUBLISHED
    protocol: chat_completions
    kind: answer
rewards:
  - key: exact-match
    version: 1.0.0
    grader: exact_match
datasets:
  big:
    file: {data.name}
"""
    )
    return catalog
