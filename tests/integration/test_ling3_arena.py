"""One Flash-V3-style Arena task in the Ling 3 format, from the policy's text to a step.

The chain is the production one, on loopback, with the policy scripted:

* a local Arena serves the ``arith-claude-code`` Stream, whose Harness
  (``claude-code@builtin-1.0.0``) plays Claude Code: Anthropic Messages requests with
  tools, streamed, ``tool_use`` blocks run and answered with ``tool_result``;
* the Arena agent launches the task in ``direct`` route mode, hosted by the proxy workflow;
* the rollout proxy renders prompts with the Ling 3 chat template of the tiny model's
  tokenizer and parses the policy's text with the ``ling3`` tool-call and reasoning parsers,
  as arena_flash_v3.yaml configures them;
* the engine writes scripted Ling 3 text (a think block, then a ``Bash`` call whose
  ``timeout`` must come out as an integer; after the tool result a ``submit`` call),
  tokenized by that tokenizer.

The exported trajectory then goes through one PPO step of the FSDP actor on CPU.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig
from areal.infra import workflow_context
from areal.proxy.parsers import get_reasoning_parser, get_tool_call_parser
from areal.proxy.server import ProxyServer
from areal.proxy.workflow import OpenAIProxyWorkflow
from areal.trainer.ppo.actor import FSDPPPOActor
from areal.utils import stats_tracker
from areal.utils.data import concat_padded_tensors
from examples.swe.arena_agent import ArenaStreamAgentWorkflow
from examples.swe.arena_client import ArenaOpenAPIClient
from examples.swe.local_arena.harnesses.llm import AnthropicWire
from examples.swe.local_arena.testing import running_local_arena
from tests.unit.examples.test_arena_agent_fakes import ARENA_ENV
from tests.unit.proxy.conftest import ADMIN, ScriptedEngine, serve_like_the_proxy

STREAM = "arith-claude-code"
HARNESS = "claude-code@builtin-1.0.0"
DATA_ID = "multi-001"  # What is 37 * 48?
BASH_INPUT = {"command": "echo $((37 * 48))", "timeout": 5000, "description": "multiply"}
REPLIES = [
    "<think>\nI will multiply with the shell.\n</think>\n<tool_call>Bash\n"
    "<arg_key>command</arg_key>\n<arg_value>echo $((37 * 48))</arg_value>\n"
    "<arg_key>timeout</arg_key>\n<arg_value>5000</arg_value>\n"
    "<arg_key>description</arg_key>\n<arg_value>multiply</arg_value>\n</tool_call>",
    "<think>\nThe shell printed 1776.\n</think>\n<tool_call>submit\n"
    "<arg_key>answer</arg_key>\n<arg_value>1776</arg_value>\n</tool_call>",
]


@dataclass
class Exchange:
    """One ``/v1/messages`` call: the body the Harness sent, the bytes it got back."""

    request: dict[str, Any]
    response: bytes


class MessagesRecorder:
    """ASGI middleware in front of the proxy that keeps every ``/v1/messages`` exchange."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.exchanges: list[Exchange] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/messages":
            await self.app(scope, receive, send)
            return
        received: list[bytes] = []
        sent: list[bytes] = []

        async def receive_and_keep() -> dict:
            message = await receive()
            received.append(message.get("body", b""))
            return message

        async def send_and_keep(message: dict) -> None:
            if message["type"] == "http.response.body":
                sent.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive_and_keep, send_and_keep)
        self.exchanges.append(Exchange(json.loads(b"".join(received)), b"".join(sent)))


def streamed_message(raw: bytes) -> dict[str, Any]:
    """The Anthropic message a server-sent event stream adds up to (as the Harness reads it)."""
    events = [
        json.loads(line[len("data:") :])
        for line in raw.decode().splitlines()
        if line.startswith("data:")
    ]
    return AnthropicWire().assemble(events)


@pytest.fixture(autouse=True)
async def isolated(monkeypatch):
    for name in ARENA_ENV:
        monkeypatch.delenv(name, raising=False)
    stats_tracker.export_all()
    yield
    await workflow_context.close_clients()


async def run_one_task(tmp_path, tokenizer, engine) -> tuple[dict, list[Exchange], list[dict]]:
    """The task through the whole chain; returns (exported interactions, LLM exchanges,
    result records)."""
    proxy = ProxyServer(
        engine,
        tokenizer,
        ADMIN,
        tool_call_parser=get_tool_call_parser("ling3"),
        reasoning_parser=get_reasoning_parser("ling3"),
        engine_max_tokens=8192,
    )
    recorder = MessagesRecorder(proxy.app)
    results = tmp_path / "results"
    with (
        running_local_arena(tmp_path / "arena") as arena,
        serve_like_the_proxy(recorder) as proxy_url,
    ):
        client = ArenaOpenAPIClient(
            base_url=arena.base_url, api_token=arena.token, poll_interval=0.05
        )
        rows = await client.get_all_dataset_rows_async(STREAM, "anthropic")
        row = next(r for r in rows if r["data_id"] == DATA_ID)
        stream = {
            "name": "cc",
            "stream_id": STREAM,
            "harness": HARNESS,
            "llm_protocol": "anthropic",
        }
        agent = ArenaStreamAgentWorkflow(
            {
                "arena_streams": [stream],
                "arena_llm_route_mode": "direct",
                "arena_result_dump_dir": str(results),
            },
            arena_client=client,
        )
        workflow = OpenAIProxyWorkflow(agent=agent, proxy_addr=proxy_url, admin_api_key=ADMIN)
        try:
            with workflow_context.scoped(task_id=0):
                exported = await workflow.arun_episode(None, {**row, "arena_stream_name": "cc"})
        finally:
            await client.aclose()
    records = [
        json.loads(line)
        for shard in sorted(results.glob("arena_results_*.jsonl"))
        for line in shard.read_text().splitlines()
    ]
    return exported, recorder.exchanges, records


def check_harness_exchanges(exchanges: list[Exchange]) -> None:
    """The Harness got a thinking block and a typed ``tool_use``, ran it, sent the result."""
    first, second = exchanges
    assert first.request["stream"] is True
    assert [t["name"] for t in first.request["tools"]] == ["Bash", "submit"]
    reply = streamed_message(first.response)
    assert reply["stop_reason"] == "tool_use"
    thinking, tool_use = reply["content"]
    assert thinking["type"] == "thinking" and thinking["signature"]
    assert thinking["thinking"] == "\nI will multiply with the shell.\n"
    assert tool_use["type"] == "tool_use" and tool_use["name"] == "Bash"
    assert tool_use["input"] == BASH_INPUT
    assert type(tool_use["input"]["timeout"]) is int  # typed by the tool's JSON schema

    user, assistant, results = second.request["messages"]
    assert user == {"role": "user", "content": "What is 37 * 48? Answer with a number."}
    assert assistant == {"role": "assistant", "content": [thinking, tool_use]}  # echoed as is
    assert results["role"] == "user"
    assert results["content"] == [
        {"type": "tool_result", "tool_use_id": tool_use["id"], "content": "1776"}
    ]
    final = streamed_message(second.response)
    assert [b["type"] for b in final["content"]] == ["thinking", "tool_use"]
    assert final["content"][1]["name"] == "submit"
    assert final["content"][1]["input"] == {"answer": "1776"}


def check_recorded_tokens(exported: dict, engine: ScriptedEngine, tokenizer: Any) -> None:
    """Each interaction is the prompt the engine got plus exactly the tokens it wrote."""
    interactions = list(exported.values())
    assert len(interactions) == len(engine.requests) == 2
    for interaction, request, response, text in zip(
        interactions, engine.requests, engine.responses, REPLIES, strict=True
    ):
        written = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert response.output_tokens == [*written, tokenizer.eos_token_id]
        prompt, output = list(request.input_ids), list(response.output_tokens)
        tensors = interaction.to_tensor_dict()
        assert tensors["input_ids"][0].tolist() == prompt + output
        assert tensors["loss_mask"][0].tolist() == [0] * len(prompt) + [1] * len(output)
        torch.testing.assert_close(
            tensors["logprobs"][0, len(prompt) :], torch.tensor(response.output_logprobs)
        )
        assert interaction.reward == 1.0  # the final score, carried back to the first turn
    # the second prompt re-renders the first turn token for token (the chat template's
    # prefix property), so the first call's tokens are a prefix of the second prompt
    first_sequence = list(engine.requests[0].input_ids) + engine.responses[0].output_tokens
    assert list(engine.requests[1].input_ids)[: len(first_sequence)] == first_sequence
    tags = {tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "<tool_call>", "<arg_key>")}
    assert tags <= set(engine.responses[0].output_tokens)


def train_one_step(model_dir, exported: dict) -> None:
    """One PPO step of the FSDP actor on the exported trajectory: finite loss, new weights."""
    config = PPOActorConfig(
        experiment_name="ling3-arena",
        trial_name="one-step",
        path=str(model_dir),
        dtype="float32",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=4096),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps_proportion=0.0),
        ppo_n_minibatches=1,
        kl_ctl=0.0,
        use_decoupled_loss=True,
        prox_logp_method="reuse_train_logp",
    )
    actor = FSDPPPOActor(config)
    actor.create_process_group()
    actor.initialize()
    try:
        before = actor._full_state_dict()
        batch = concat_padded_tensors([i.to_tensor_dict() for i in exported.values()])
        stats_tracker.export_all()
        stats = actor.ppo_update(actor.compute_advantages(batch))
        logged = stats_tracker.export_all()
        after = actor._full_state_dict()
    finally:
        actor.destroy()
    assert [s["update_successful"] for s in stats] == [1.0]
    (loss_key,) = [k for k in logged if k.endswith("actor_loss")]
    assert math.isfinite(logged[loss_key]) and logged[loss_key] != 0.0
    assert any(not torch.equal(before[name], after[name]) for name in before)


async def test_ling3_task_through_the_local_arena_trains(tmp_path, ling3_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(ling3_model_dir)
    engine = ScriptedEngine(tokenizer, REPLIES)

    exported, exchanges, records = await run_one_task(tmp_path, tokenizer, engine)

    check_harness_exchanges(exchanges)
    (record,) = records
    assert (record["status"], record["arena_score"], record["training_score"]) == (
        "DONE",
        1.0,
        1.0,
    )
    assert record["raw"]["answer"] == "1776" and record["raw"]["turns"] == 2
    tool_turn = next(t for t in record["raw"]["transcript"] if t["role"] == "tool")
    assert (tool_turn["name"], tool_turn["output"]) == ("Bash", "1776")
    check_recorded_tokens(exported, engine, tokenizer)
    train_one_step(ling3_model_dir, exported)
