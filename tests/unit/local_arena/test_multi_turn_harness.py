"""The ``multi_turn`` harness and the ``env_latency_ms`` fault setting (environment time).

The harness runs against the scripted upstream of :mod:`.test_harnesses`; the end-to-end
case runs the catalog's ``arith-turns`` Stream through a running local Arena, its gateway
and a stub chat upstream. Environment time is kept small (0.2-0.3 s a turn) so the whole
file sleeps under two seconds.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from areal.utils.serving import serve_in_thread
from examples.swe.arena_client import ArenaOpenAPIClient
from examples.swe.local_arena.catalog import DEFAULT_CATALOG, load_catalog
from examples.swe.local_arena.harnesses import run_harness
from examples.swe.local_arena.harnesses.builtin import ANSWER_SYSTEM, OBSERVATION
from examples.swe.local_arena.testing import running_local_arena
from examples.swe.local_arena.types import LLM_PROTOCOLS, CatalogError, HarnessError
from tests.fakes.stub_llm import StubLLM
from tests.unit.local_arena import test_harnesses as harness_tests
from tests.unit.local_arena.test_harnesses import PATHS, PROMPT, assert_session_headers, spec

STREAM = "arith-turns"

# The scripted upstream and the runs against it, shared with the harness tests.
upstream_server = harness_tests.upstream_server
upstream = harness_tests.upstream
make_run = harness_tests.make_run


def replies(count: int) -> list[dict[str, str]]:
    return [{"content": f"reply {k}"} for k in range(1, count + 1)]


# --- multi_turn against the scripted upstream ---


@pytest.mark.parametrize("turns", [None, 1, 4], ids=["default", "one", "four"])
async def test_multi_turn_sends_history_and_observations(upstream, make_run, turns) -> None:
    expected = 3 if turns is None else turns  # the harness's default is 3 turns
    upstream.reset(*replies(expected))
    options = {} if turns is None else {"turns": turns}
    output = await run_harness(spec("multi_turn", **options), make_run())
    requests = upstream.calls()
    assert len(requests) == expected
    assert_session_headers(requests)
    for k, request in enumerate(requests, start=1):
        # request k: the prompt, then each earlier reply followed by one observation
        earlier = []
        for j in range(1, k):
            earlier += [
                {"role": "assistant", "content": f"reply {j}"},
                {"role": "user", "content": OBSERVATION},
            ]
        assert request.body["messages"] == [
            {"role": "system", "content": ANSWER_SYSTEM},
            {"role": "user", "content": PROMPT},
            *earlier,
        ]
    assert output.answer == f"reply {expected}"
    assert output.turns == expected
    assert [t["text"] for t in output.transcript] == [f"reply {k}" for k in range(1, expected + 1)]


@pytest.mark.parametrize("protocol", LLM_PROTOCOLS)
async def test_multi_turn_speaks_every_protocol(upstream, make_run, protocol) -> None:
    upstream.reset(*replies(2))
    output = await run_harness(spec("multi_turn", protocol, turns=2), make_run())
    requests = upstream.calls()
    assert [r.path for r in requests] == [PATHS[protocol]] * 2
    assert OBSERVATION in str(requests[1].body) and "reply 1" in str(requests[1].body)
    assert OBSERVATION not in str(requests[0].body)
    assert (output.answer, output.turns) == ("reply 2", 2)


async def test_multi_turn_answer_is_the_last_non_empty_reply(upstream, make_run) -> None:
    upstream.reset({"content": "reply 1"}, {"content": "reply 2"}, {"content": ""})
    output = await run_harness(spec("multi_turn", turns=3), make_run())
    assert len(upstream.calls()) == 3
    assert (output.answer, output.turns) == ("reply 2", 3)


async def test_multi_turn_spends_env_seconds_after_every_call(upstream, make_run) -> None:
    upstream.reset(*replies(3))
    run = make_run()
    run.env_seconds = 0.2
    started = time.monotonic()
    output = await run_harness(spec("multi_turn", turns=3), run)
    elapsed = time.monotonic() - started
    # 3 calls x 0.2 s: 0.6 s needs the wait after the last call too, not only between calls
    assert 0.6 <= elapsed < 5.0
    assert (output.answer, output.turns) == ("reply 3", 3)


@pytest.mark.parametrize("turns", [0, 101, "3", True, 2.0], ids=repr)
async def test_invalid_turns_is_a_harness_error(upstream, make_run, turns) -> None:
    with pytest.raises(HarnessError, match=r"options\.turns must be an integer in \[1, 100\]"):
        await run_harness(spec("multi_turn", turns=turns), make_run())
    assert upstream.calls() == []  # refused before any LLM call


async def test_answer_spends_env_seconds_after_its_call(upstream, make_run) -> None:
    upstream.reset({"content": "42"})
    run = make_run()
    run.env_seconds = 0.2
    started = time.monotonic()
    output = await run_harness(spec("answer"), run)
    elapsed = time.monotonic() - started
    assert 0.2 <= elapsed < 5.0
    assert (output.answer, output.turns) == ("42", 1)
    assert len(upstream.calls()) == 1


# --- end to end through a local Arena ---


def numbered_reply(body: dict) -> str:
    """``reply k`` for the k-th turn of a conversation (one more than its assistant turns)."""
    return f"reply {1 + sum(m['role'] == 'assistant' for m in body['messages'])}"


async def test_env_latency_reaches_a_multi_turn_task(tmp_path) -> None:
    stub = StubLLM(numbered_reply)
    row = load_catalog(DEFAULT_CATALOG).rows(STREAM)[0]
    with (
        serve_in_thread(stub.app()) as upstream_url,
        running_local_arena(tmp_path, task_timeout=30) as arena,
    ):
        faults_url = f"{arena.base_url}/openapi/v1/local/faults"
        headers = {"Authorization": f"Bearer {arena.token}"}
        async with httpx.AsyncClient(headers=headers, timeout=10) as http:
            refused = await http.put(faults_url, json={"env_latency_ms": 1e30})
            assert refused.status_code == 400
            assert "env_latency_ms" in refused.json()["error"]["message"]
            accepted = await http.put(faults_url, json={"env_latency_ms": 300})
            assert accepted.status_code == 200 and accepted.json()["env_latency_ms"] == 300
        client = ArenaOpenAPIClient(
            base_url=arena.base_url,
            api_token=arena.token,
            llm_api_key=arena.token,
            poll_interval=0.05,
        )
        name = f"stream-areal-{uuid.uuid4().hex[:12]}"
        gateway, name = await client.register_llm_proxy_async(
            name, upstream_url, "upstream-key", str(uuid.uuid4())
        )
        started = time.monotonic()
        result = await client.launch_one_task_result(
            STREAM, row.data_id, name, gateway, arena.token
        )
        elapsed = time.monotonic() - started
        await client.aclose()
    assert result.status == "DONE", result.raw
    assert result.raw["harness"] == "chat-turns@1.0.0"
    assert result.raw["turns"] == 3
    assert result.raw["answer"] == "reply 3"
    assert 0.9 <= elapsed < 20  # 3 turns x 300 ms of environment time
    assert len(stub.calls) == 3
    assert all(call.body["max_tokens"] == 16 for call in stub.calls)
    assert [m["role"] for m in stub.calls[-1].body["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]


def test_a_catalog_with_bad_turns_is_refused_at_load(tmp_path):
    """``options.turns`` of a multi_turn harness is checked when the catalog loads."""
    text = DEFAULT_CATALOG.read_text().replace(
        "options: {turns: 3, max_tokens: 16}", "options: {turns: 0, max_tokens: 16}"
    )
    assert "turns: 0" in text
    bad = tmp_path / "catalog.yaml"
    bad.write_text(text.replace("file: datasets/", f"file: {DEFAULT_CATALOG.parent}/datasets/"))
    with pytest.raises(CatalogError, match=r"options\.turns.*\[1, 100\], got 0"):
        load_catalog(bad)
