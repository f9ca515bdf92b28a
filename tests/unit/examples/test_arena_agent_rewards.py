"""ArenaStreamAgentWorkflow rewards and metrics (docs/arena_training.md; cases W1-W6, W11)."""

from __future__ import annotations

import json
import math
import os
import socket
import stat

import pytest

from areal.infra import workflow_context
from tests.unit.examples.test_arena_agent_fakes import (
    ARENA_ENV,
    HARNESS,
    ROW,
    FakeArena,
    make_agent,
    metrics,
    run_kwargs,
)

ASTRA = "examples.swe.reward_transforms.astra_partial_reward"
IDENTITY = "examples.swe.reward_transforms.identity_reward"
transform_calls: list[tuple] = []


def recording_transform(reward, data, *, reward_threshold):
    """W3: a custom transform that must receive the threshold keyword."""
    transform_calls.append((reward, data, reward_threshold))
    return 0.875


def add_a_quarter(reward, data):
    return reward + 0.25


def not_a_number(reward, data):
    return float("nan")


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    for name in ARENA_ENV:
        monkeypatch.delenv(name, raising=False)
    metrics()
    transform_calls.clear()


@pytest.fixture
def fake() -> FakeArena:
    return FakeArena()


def two_streams(**b_overrides) -> list[dict]:
    b = {
        "name": "b",
        "stream_id": "stream-b",
        "harness": "codex@2.0",
        "task_envs": {"B_ONLY": "1"},
        "reward_transform_fn": "tests.unit.examples.test_arena_agent_rewards.add_a_quarter",
        "expected_reward_ref": {"key": "grader", "version": "3"},
    }
    b.update(b_overrides)
    return [{"name": "a", "stream_id": "stream-a", "harness": HARNESS}, b]


# --- thresholds and transforms ---


def test_threshold_without_transform_maps_to_zero_or_one(fake):
    # W1: 0.98 -> 1.0, 0.9799 -> 0.0, 1.0 -> 1.0
    agent = make_agent(fake, arena_reward_threshold=0.98)
    assert [agent._transform_reward(r, ROW) for r in (0.98, 0.9799, 1.0)] == [1.0, 0.0, 1.0]
    assert make_agent(fake)._transform_reward(7.5, ROW) == 7.5  # no range check


async def test_threshold_applies_to_the_launched_task_score(fake):
    fake.polls = [{"status": "DONE", "score": 0.98}]
    assert await make_agent(fake, arena_reward_threshold=0.98).run(dict(ROW), **run_kwargs()) == 1


def test_astra_partial_reward_through_the_stream_config(fake):
    # W2: default threshold 0.98; below it a tenth of the score.
    agent = make_agent(fake, arena_reward_transform_fn=ASTRA)
    table = {0.0: 0.0, 0.2: 0.02, 0.75: 0.075, 0.9799: 0.09799, 0.98: 1.0, 1.0: 1.0}
    for score, expected in table.items():
        assert agent._transform_reward(score, ROW) == pytest.approx(expected), score
    for bad in (-0.01, 1.01, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"within \[0, 1\]"):
            agent._transform_reward(bad, ROW)
    # A configured threshold is passed through to the transform.
    agent = make_agent(fake, arena_reward_transform_fn=ASTRA, arena_reward_threshold=0.9)
    table = {0.8999: 0.08999, 0.9: 1.0, 0.95: 1.0}
    for score, expected in table.items():
        assert agent._transform_reward(score, ROW) == pytest.approx(expected), score
    identity = make_agent(fake, arena_reward_transform_fn=IDENTITY, arena_reward_threshold=0.5)
    assert identity._transform_reward(0.3, ROW) == 0.3  # the threshold is ignored


async def test_custom_transform_gets_the_threshold_keyword(fake):
    # W3
    fake.polls = [{"status": "DONE", "score": 0.25}]
    agent = make_agent(
        fake,
        arena_reward_transform_fn="tests.unit.examples.test_arena_agent_rewards.recording_transform",
        arena_reward_threshold=0.98,
    )
    row = dict(ROW)
    assert await agent.run(row, **run_kwargs()) == 0.875
    assert transform_calls == [(0.25, row, 0.98)]


def test_transforms_are_resolved_at_construction(fake):
    with pytest.raises(ImportError, match="no module 'no_such_package'"):
        make_agent(fake, arena_reward_transform_fn="no_such_package.module.fn")
    with pytest.raises(ImportError, match="has no attribute 'missing'"):
        make_agent(fake, arena_reward_transform_fn="examples.swe.reward_transforms.missing")


# --- episode metrics ---


async def test_episode_metrics_after_a_transformed_reward(fake):
    # W4: score 0.75 -> astra 0.075; the Arena score is kept as the raw reward.
    fake.polls = [{"status": "DONE", "score": 0.75, "raw": {"tests": 4}, "trace_id": "tr-1"}]
    agent = make_agent(fake, arena_reward_transform_fn=ASTRA)
    reward = await agent.run(dict(ROW), **run_kwargs())
    assert reward == pytest.approx(0.075)
    run_stats = metrics()
    assert not any(k.rsplit("/", 1)[-1] in ("reward", "raw_reward") for k in run_stats)

    await agent.persist_episode_result(dict(ROW), reward)
    agent.record_episode_metrics(dict(ROW), reward)

    stats = metrics()
    assert stats["rollout/swe/reward"] == pytest.approx(0.075)
    assert stats["rollout/domain/swe/reward"] == pytest.approx(0.075)
    assert stats["rollout/raw_reward"] == pytest.approx(0.75)
    assert stats["rollout/arena_score"] == pytest.approx(0.75)
    assert stats["rollout/swe/raw_reward"] == pytest.approx(0.75)
    assert stats["rollout/domain/swe/raw_reward"] == pytest.approx(0.75)
    assert stats["rollout/training_score"] == pytest.approx(0.075)
    assert stats["rollout/stream/default/training_score"] == pytest.approx(0.075)
    assert stats["rollout/stream/default/arena_score"] == pytest.approx(0.75)
    assert stats["debug/task/data-1/raw_reward"] == pytest.approx(0.75)
    assert stats["rollout/arena_raw_present"] == 1.0
    assert stats["rollout/arena_trace_present"] == 1.0
    assert stats["rollout/arena_artifacts_present"] == 0.0
    assert stats["rollout/harness_success"] == 1.0 and stats["rollout/harness_error"] == 0.0
    assert not any(k.startswith("rollout/task/") for k in stats)
    # The slot is cleared: a second call has no Arena score to report.
    agent.record_episode_metrics(dict(ROW), 0.5)
    assert "rollout/arena_score" not in metrics()


def test_episode_metrics_in_eval_scope(fake):
    # W6
    agent = make_agent(fake)
    with workflow_context.scoped(is_eval=True):
        agent.record_episode_metrics(dict(ROW), 1.0)
    stats = metrics()
    assert stats["eval-rollout/swe/reward"] == 1.0
    assert stats["eval-rollout/swe/reward__count"] == 1
    assert not any(k.startswith("rollout/") for k in stats)


# --- group metrics ---


def pass_at_k(agent, rewards, row=ROW) -> float:
    agent.record_group_metrics(dict(row), rewards, len(rewards))
    stats = metrics()
    scope = "eval-rollout" if workflow_context.get().is_eval else "rollout"
    return stats[f"{scope}/pass@k"]


def test_pass_at_k_follows_the_stream_reward_mapping(fake):
    # W5
    plain = make_agent(fake)
    assert pass_at_k(plain, [0, None, 1, 0]) == 1.0
    assert pass_at_k(plain, [0, None, -1]) == 0.0
    astra = make_agent(fake, arena_reward_transform_fn=ASTRA, arena_reward_threshold=0.98)
    assert pass_at_k(astra, [0, 0.05, 0.09]) == 0.0  # partial credit is not a pass
    astra.record_group_metrics(dict(ROW), [0.09799, 1.0], 2)
    stats = metrics()
    assert stats["rollout/pass@k"] == 1.0 and stats["rollout/group_pass_1"] == 1.0
    assert stats["rollout/group_pass_0"] == 0.0 and stats["rollout/group_pass_2"] == 0.0
    assert pass_at_k(make_agent(fake, arena_reward_threshold=2.0), [1, 0]) == 1.0
    assert pass_at_k(make_agent(fake, arena_reward_threshold=0.0), [0, 0]) == 0.0
    with workflow_context.scoped(is_eval=True):
        assert pass_at_k(plain, [1, 0]) == 1.0


@pytest.mark.parametrize("task_type", [None, 3, "  ", ["swe"]])
def test_invalid_task_types_count_as_unknown(fake, task_type):
    row = {**ROW, "arena_task_type": task_type}
    make_agent(fake).record_group_metrics(row, [1.0, 0.0], 2)
    stats = metrics()
    assert stats["rollout/unknown/pass@k"] == 1.0
    assert stats["rollout/domain/unknown/pass@k"] == 1.0


def test_group_pass_distribution_is_one_hot(fake):
    # Four groups of 3 with 0, 1, 2 and 3 passes: each bucket averages 1/4 over 4 records.
    agent = make_agent(fake)
    for rewards in ([0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]):
        agent.record_group_metrics(dict(ROW), rewards, 3)
    stats = metrics()
    for count in range(4):
        assert stats[f"rollout/group_pass_{count}"] == 0.25
        assert stats[f"rollout/group_pass_{count}__count"] == 4
        assert stats[f"rollout/group_pass_count_{count}_ratio"] == 0.25
    with pytest.raises(ValueError, match="rewards"):
        agent.record_group_metrics(dict(ROW), [1.0], 2)


def test_group_quality_keys_per_domain_and_stream(fake):
    # per-domain and per-Stream group metrics (newer reference)
    agent = make_agent(fake, arena_streams=two_streams(), stream_id="")
    row = {**ROW, "arena_stream_name": "b", "stream_id": "stream-b", "arena_task_type": "math"}
    agent.record_group_metrics(row, [1.0, 1.0], 2)
    agent.record_group_metrics(row, [0.0, None], 2)
    stats = metrics()
    for prefix in ("rollout/", "rollout/domain/math/", "rollout/stream/b/"):
        assert stats[f"{prefix}all_correct"] == 0.5 and stats[f"{prefix}all_correct__count"] == 2
        assert stats[f"{prefix}all_wrong"] == 0.5
        assert stats[f"{prefix}group_pass_count_2_ratio"] == 0.5
        assert stats[f"{prefix}group_pass_count_1_ratio"] == 0.0
        assert stats[f"{prefix}pass@k"] == 0.5
    assert stats["rollout/math/pass@k"] == 0.5


# --- per-Stream routing and the audit shard ---


async def test_rows_use_their_own_stream(fake, tmp_path):
    # W11
    dump = tmp_path / "audit" / "shards"
    fake.streams["stream-b"] = {
        "stream_id": "stream-b",
        "status": "ACTIVE",
        "default_reward_ref": {"key": "grader", "version": "3"},
    }
    raw = {"checks": [1, None, {"ok": True}], "note": "é"}
    fake.polls = [{"status": "DONE", "score": 0.5, "raw": raw, "artifacts_uri": "s3://x"}]
    agent = make_agent(
        fake,
        arena_streams=two_streams(),
        stream_id="",
        arena_task_envs={"COMMON": "c"},
        arena_result_dump_dir=str(dump),
    )
    row = {
        **ROW,
        "arena_stream_name": "b",
        "stream_id": "stream-b",
        "llm_protocol": "responses",
        "reward_ref_key": "grader",
        "reward_ref_version": "3",
    }

    reward = await agent.run(row, **run_kwargs())
    await agent.persist_episode_result(row, reward)
    agent.record_episode_metrics(row, reward)

    assert reward == 0.75
    (launch,) = fake.ops("launch")
    assert launch.name == "stream-b" and launch.body["harness"] == "codex@2.0"
    assert launch.body["envs"]["B_ONLY"] == "1" and launch.body["envs"]["COMMON"] == "c"
    assert fake.ops("register")[0].body["endpoints"][0]["inbound_protos"] == ["chat"]
    stats = metrics()
    assert stats["rollout/arena_score"] == 0.5 and stats["rollout/training_score"] == 0.75
    assert stats["rollout/arena_raw_present"] == 1.0
    assert stats["rollout/stream/b/arena_score"] == 0.5
    assert stats["rollout/arena/reward_ref_validation_success"] == 1.0
    assert stats["rollout/arena/result_dump_success"] == 1.0
    (shard,) = dump.iterdir()
    assert shard.name == f"arena_results_{socket.gethostname()}_{os.getpid()}.jsonl"
    assert stat.S_IMODE(shard.stat().st_mode) == 0o600
    assert stat.S_IMODE(dump.stat().st_mode) == 0o700
    (line,) = shard.read_text(encoding="utf-8").splitlines()
    assert '"note":"é"' in line  # compact, non-ASCII kept
    record = json.loads(line)
    assert record["arena_stream_name"] == "b" and record["stream_id"] == "stream-b"
    assert record["task_id"] == record["arena_task_id"] == "task-1"
    assert record["status"] == "DONE" and record["data_id"] == "data-1"
    assert record["expected_reward_ref"] == {"key": "grader", "version": "3"}
    assert record["arena_score"] == 0.5 and record["training_score"] == 0.75
    assert record["raw"] == raw and record["raw_present"] is True
    assert record["raw_size_bytes"] == len(
        json.dumps(raw, ensure_ascii=False, separators=(",", ":")).encode()
    )
    assert record["raw_truncated"] is False and record["artifacts_uri"] == "s3://x"
    assert record["session_id"] == "sess-1" and record["harness_outcome_code"] is None


async def test_multi_stream_rows_must_name_a_known_stream(fake):
    agent = make_agent(fake, arena_streams=two_streams(), stream_id="")
    with pytest.raises(ValueError, match="arena_stream_name is required"):
        await agent.run({**ROW, "arena_stream_name": ""}, **run_kwargs())
    with pytest.raises(ValueError, match="unknown Arena Stream"):
        await agent.run({**ROW, "arena_stream_name": "zzz"}, **run_kwargs())
    with pytest.raises(ValueError, match="row Stream mismatch"):
        await agent.run({**ROW, "arena_stream_name": "a", "stream_id": "stream-b"}, **run_kwargs())
    assert fake.calls == []


async def test_oversized_raw_is_left_out_of_the_record(fake, tmp_path):
    raw = {"log": "x" * 100}
    fake.polls = [{"status": "DONE", "score": 1.0, "raw": raw}]
    agent = make_agent(fake, arena_result_dump_dir=str(tmp_path), arena_result_dump_max_bytes=50)
    await agent.persist_episode_result(dict(ROW), await agent.run(dict(ROW), **run_kwargs()))
    (shard,) = tmp_path.glob("arena_results_*.jsonl")
    record = json.loads(shard.read_text())
    assert record["raw"] is None and record["raw_present"] is True
    # {"log":"x...x"}: 8 + 100 + 2 bytes
    assert record["raw_truncated"] is True and record["raw_size_bytes"] == 110


# --- metadata and export hooks (newer reference) ---


async def test_session_and_episode_metadata(fake):
    assert make_agent(fake).get_session_metadata(ROW) == {}
    agent = make_agent(fake)
    agent.gen_args = {"temperature": 1.0, "top_p": 1.0}
    assert agent.get_session_metadata(ROW) == {
        "generation_args": {"temperature": 1.0, "top_p": 1.0}
    }
    await agent.run(dict(ROW), **run_kwargs("sess-7"))
    assert agent.get_episode_metadata() == {
        "session_id": "sess-7",
        "arena_task_id": "task-1",
        "arena_status": "DONE",
    }


@pytest.mark.parametrize(
    "status, style, expected",
    [
        ("DONE", "concat", 0.5),
        ("OK", "concat", 0.5),
        ("DONE", "individual", None),
        ("HARNESS_FAILED", "concat", None),
    ],
)
def test_concat_episode_reward_only_for_successful_results(fake, status, style, expected):
    from examples.swe.arena_results import ArenaTaskResult

    agent = make_agent(fake)
    agent._current_episode().result = ArenaTaskResult("t-1", status, 0.5)
    assert agent.get_episode_reward_for_export(ROW, 0.5, export_style=style) == expected
    if expected is not None:
        assert agent.get_episode_reward_for_export(ROW, math.nan, export_style=style) is None
    assert agent.get_failure_reward_for_export(ROW, export_style=style) == (
        0.0 if style == "concat" else None
    )


def test_concat_episode_reward_needs_a_stored_result(fake):
    agent = make_agent(fake)
    assert agent.get_episode_reward_for_export(ROW, 1.0, export_style="concat") is None
