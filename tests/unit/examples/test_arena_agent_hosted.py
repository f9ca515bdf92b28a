"""ArenaStreamAgentWorkflow hosted by the real proxy workflow
(docs/design.md#data-path-of-one-arena-task).

Everything runs over loopback HTTP: the proxy (scripted engine), a fake Arena whose
"Harness" calls the proxy with the launch credentials, and the agent in between.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from transformers import AutoTokenizer

from areal.infra import workflow_context
from areal.proxy.workflow import OpenAIProxyWorkflow
from examples.swe.arena_agent import ArenaStreamAgentWorkflow
from examples.swe.arena_client import ArenaOpenAPIClient, ArenaTaskFailedError
from tests.fakes.live_server import serve
from tests.unit.examples.test_arena_agent_fakes import (
    ARENA_ENV,
    ROW,
    TOKEN,
    FakeArena,
    FakeArenaASGI,
    metrics,
)
from tests.unit.proxy.conftest import ADMIN, ScriptedEngine, running_proxy

ASTRA = "examples.swe.reward_transforms.astra_partial_reward"
CLAUDE_TOO_LONG = (
    "harness: harness agent phase exited with code 1\n"
    "harness: agent phase error: claude reported error: prompt is too long"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(autouse=True)
async def isolated(monkeypatch):
    for name in ARENA_ENV:
        monkeypatch.delenv(name, raising=False)
    metrics()
    yield
    await workflow_context.close_clients()


async def harness_calls_the_proxy(request: httpx.Request) -> None:
    """What a Harness does with the launch body: talk to the model it was given."""
    body = json.loads(request.content)
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{body['base_url']}/v1/chat/completions",
            headers={"Authorization": f"Bearer {body['api_key']}"},
            json={
                "model": body["model_name"],
                "messages": [{"role": "user", "content": "fix the failing test"}],
                "max_tokens": 8,
            },
        )
        response.raise_for_status()
    return None  # then the fake answers the launch as usual


def hosted(fake: FakeArena, tokenizer, tmp_path, **econfig):
    """Run one hosted episode; returns (exported interactions or error, records)."""

    async def episode():
        with (
            serve(FakeArenaASGI(fake)) as arena_url,
            running_proxy(
                ScriptedEngine(tokenizer, ["the answer"]), tokenizer, engine_max_tokens=200
            ) as (proxy_url, _),
        ):
            client = ArenaOpenAPIClient(
                base_url=arena_url, api_token=TOKEN, poll_interval=0.01, request_retries=0
            )
            agent = ArenaStreamAgentWorkflow(
                {
                    "stream_id": "stream-a",
                    "arena_llm_route_mode": "direct",
                    "arena_result_dump_dir": str(tmp_path),
                    **econfig,
                },
                arena_client=client,
            )
            workflow = OpenAIProxyWorkflow(agent=agent, proxy_addr=proxy_url, admin_api_key=ADMIN)
            with workflow_context.scoped(task_id=5):
                try:
                    return await workflow.arun_episode(None, dict(ROW))
                finally:
                    await client.aclose()

    return episode()


def shard_records(directory) -> list[dict]:
    (shard,) = directory.glob("arena_results_*.jsonl")
    return [json.loads(line) for line in shard.read_text().splitlines()]


async def test_hosted_success_exports_the_transformed_reward(tokenizer, tmp_path):
    fake = FakeArena()
    fake.script("launch", harness_calls_the_proxy)
    fake.polls = [{"status": "DONE", "score": 0.75, "raw": {"passed": 3}}]

    exported = await hosted(fake, tokenizer, tmp_path, arena_reward_transform_fn=ASTRA)

    (interaction,) = exported.values()
    assert interaction.reward == pytest.approx(0.075)
    assert interaction.metadata["arena_task_id"] == "task-1"
    assert interaction.metadata["arena_status"] == "DONE"
    # <task id>-<n>.<nonce of this proxy start>: never reused by a restart
    assert re.fullmatch(r"5-0\.[0-9a-f]{8}", interaction.metadata["session_id"])
    stats = metrics()
    assert stats["rollout/reward"] == pytest.approx(0.075)  # recorded by the proxy workflow
    assert stats["rollout/swe/reward"] == pytest.approx(0.075)
    assert stats["rollout/raw_reward"] == pytest.approx(0.75)
    assert stats["debug/task/data-1/raw_reward"] == pytest.approx(0.75)
    assert stats["rollout/arena/call_success"] == 1.0
    (record,) = shard_records(tmp_path)
    assert record["training_score"] == pytest.approx(0.075) and record["arena_score"] == 0.75
    assert re.fullmatch(r"5-0\.[0-9a-f]{8}", record["session_id"])
    assert record["raw"] == {"passed": 3}


async def test_hosted_model_failure_trains_with_zero(tokenizer, tmp_path):
    fake = FakeArena()
    fake.script("launch", harness_calls_the_proxy)
    fake.polls = [{"status": "HARNESS_FAILED", "score": 0.0, "raw": {"error": CLAUDE_TOO_LONG}}]

    exported = await hosted(fake, tokenizer, tmp_path)

    (interaction,) = exported.values()
    assert interaction.reward == 0.0
    assert interaction.metadata["arena_status"] == "HARNESS_FAILED"
    (record,) = shard_records(tmp_path)
    assert record["status"] == "HARNESS_FAILED" and record["training_score"] == 0.0
    assert metrics()["rollout/harness_error"] == 1.0


async def test_hosted_system_failure_rejects_the_sample(tokenizer, tmp_path):
    fake = FakeArena()
    fake.script("launch", harness_calls_the_proxy)
    fake.polls = [{"status": "SETUP_FAILED", "raw": {"error": "image pull"}}]

    with pytest.raises(ArenaTaskFailedError, match="SETUP_FAILED"):
        await hosted(fake, tokenizer, tmp_path)

    (record,) = shard_records(tmp_path)
    assert record["status"] == "SETUP_FAILED" and record["training_score"] is None
