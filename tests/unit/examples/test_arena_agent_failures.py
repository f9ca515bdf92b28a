"""ArenaStreamAgentWorkflow failures and audit (cases W7-W10, W12-W17 and the newer
reference's extras). Dispositions follow docs/arena_training.md, "Failures"."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket

import httpx
import pytest

from examples.swe.arena_agent import ArenaStreamAgentWorkflow, harness_outcome_code
from examples.swe.arena_client import ArenaAPIError, ArenaOpenAPIClient, ArenaTaskFailedError
from examples.swe.arena_results import ArenaTaskResult
from tests.unit.examples.test_arena_agent_fakes import (
    ARENA_ENV,
    BASE,
    ROW,
    FakeArena,
    LogRecords,
    make_agent,
    metrics,
    run_kwargs,
)

CLAUDE_TOO_LONG = (
    "harness: harness agent phase exited with code 1\n"
    "harness: agent phase error: claude reported error: Prompt is too long"
)


def not_a_number(reward, data):
    return float("nan")


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    for name in ARENA_ENV:
        monkeypatch.delenv(name, raising=False)
    metrics()


@pytest.fixture
def fake() -> FakeArena:
    return FakeArena()


@pytest.fixture
def logs():
    handler = LogRecords()
    logger = logging.getLogger("areal")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def records(directory) -> list[dict]:
    return [
        json.loads(line)
        for shard in sorted(directory.glob("arena_results_*.jsonl"))
        for line in shard.read_text(encoding="utf-8").splitlines()
    ]


def failed(status: str, raw=None, score=None) -> ArenaTaskFailedError:
    result = ArenaTaskResult("task-9", status, score, raw)
    return ArenaTaskFailedError("task-9", status, {"status": status, "raw": raw}, result)


# --- outcomes of run ---


async def test_failed_terminal_status_records_the_outcome(fake):
    # W7
    fake.polls = [{"status": "RUNNING"}, {"status": "COLLECT_FAILED", "raw": {"log": "x"}}]
    agent = make_agent(fake)
    with pytest.raises(ArenaTaskFailedError, match="COLLECT_FAILED") as caught:
        await agent.run(dict(ROW), **run_kwargs())
    assert caught.value.result.raw == {"log": "x"}
    assert agent._current_episode().result is caught.value.result  # kept for the hooks
    stats = metrics()
    assert stats["rollout/arena/call_success"] == 0.0
    assert stats["rollout/arena/registration_success"] == 1.0
    assert stats["rollout/arena/launch_success"] == 1.0
    assert stats["rollout/arena/terminal_success"] == 0.0
    assert stats["rollout/arena/cleanup_success"] == 1.0


def timeout_warning(caplog) -> logging.LogRecord:
    """The one warning of a timed-out run: the key=value line of the agent."""
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.name == "areal.arena.agent"
    assert record.msg == "arena task timed out: task_id=%s data_id=%s timeout_s=%s"
    return record


async def test_episode_timeout_after_launch(fake, areal_logs, tmp_path):
    # W8
    fake.polls = [{"status": "RUNNING"}]
    agent = make_agent(fake, timeout=0.05, arena_result_dump_dir=str(tmp_path))
    with pytest.raises(TimeoutError) as caught:
        await agent.run(dict(ROW), **run_kwargs())
    assert type(caught.value) is TimeoutError
    assert "did not finish within the episode timeout of 0.05s" in str(caught.value)
    warning = timeout_warning(areal_logs)
    assert warning.args == ("task-1", "data-1", 0.05)
    assert warning.getMessage() == (
        "arena task timed out: task_id=task-1 data_id=data-1 timeout_s=0.05"
    )
    (record,) = records(tmp_path)
    assert record["status"] == "LOCAL_WAIT_TIMEOUT" and record["task_id"] == "task-1"
    assert record["arena_score"] is None and record["training_score"] is None
    stats = metrics()
    assert stats["rollout/arena/launch_success"] == 1.0
    assert stats["rollout/arena/terminal_success"] == 0.0
    assert stats["rollout/arena/call_success"] == 0.0
    assert stats["rollout/arena/cleanup_success"] == 1.0


async def test_episode_timeout_before_arena_accepts_the_task(fake, areal_logs, tmp_path):
    async def slow_launch(request):
        await asyncio.sleep(1)

    fake.script("launch", slow_launch)
    agent = make_agent(fake, timeout=0.05, arena_result_dump_dir=str(tmp_path))
    with pytest.raises(TimeoutError):
        await agent.run(dict(ROW), **run_kwargs())
    warning = timeout_warning(areal_logs)
    assert warning.args == ("unknown", "data-1", 0.05)
    assert warning.getMessage() == (
        "arena task timed out: task_id=unknown data_id=data-1 timeout_s=0.05"
    )
    assert records(tmp_path) == []  # no task id: nothing to audit
    stats = metrics()
    assert stats["rollout/arena/launch_success"] == 0.0
    assert "rollout/arena/terminal_success" not in stats
    assert stats["rollout/arena/call_success"] == 0.0


async def test_local_cancellation_audits_and_releases(fake, tmp_path):
    fake.polls = [{"status": "RUNNING"}]
    agent = make_agent(fake, arena_result_dump_dir=str(tmp_path))
    task = asyncio.create_task(agent.run(dict(ROW), **run_kwargs()))
    while len(fake.ops("poll")) < 2:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (record,) = records(tmp_path)
    assert record["status"] == "LOCAL_WAIT_CANCELLED" and record["task_id"] == "task-1"
    assert record["arena_score"] is None and record["training_score"] is None
    assert fake.op_names()[-1] == "delete"
    stats = metrics()
    assert stats["rollout/arena/terminal_success"] == 0.0
    assert stats["rollout/arena/call_success"] == 0.0


async def test_registration_failure_wins_over_cleanup_failure(fake):
    # W9
    fake.script("register", httpx.Response(409, json={"error": "conflict"}))
    fake.script("delete", httpx.Response(500, json={"error": "down"}))
    agent = make_agent(fake)
    with pytest.raises(ArenaAPIError, match="POST /openapi/v1/llm/models returned HTTP 409"):
        await agent.run(dict(ROW), **run_kwargs())
    (delete,) = fake.ops("delete")
    assert delete.name.startswith("stream-areal-")
    assert delete.name == fake.ops("register")[0].body["model_name"]
    stats = metrics()
    assert stats["rollout/arena/call_success"] == 0.0
    assert stats["rollout/arena/registration_success"] == 0.0
    assert stats["rollout/arena/cleanup_success"] == 0.0


async def test_cleanup_failure_after_success_keeps_the_reward(fake):
    # W10
    fake.polls = [{"status": "DONE", "score": 0.5}]
    fake.script("delete", httpx.Response(500, json={"error": "down"}))
    assert await make_agent(fake).run(dict(ROW), **run_kwargs()) == 0.5
    stats = metrics()
    assert stats["rollout/arena/cleanup_success"] == 0.0
    assert stats["rollout/arena/call_success"] == 1.0
    assert not any(k.rsplit("/", 1)[-1] in ("reward", "raw_reward") for k in stats)


async def test_row_reward_ref_mismatch_fails_before_any_call(fake):
    # W12
    streams = [{"name": "a", "stream_id": "stream-a", "expected_reward_ref": "grader@1"}]
    with pytest.raises(ValueError):
        make_agent(fake, arena_streams=streams)  # a string is not a reward ref
    streams[0]["expected_reward_ref"] = {"key": "grader", "version": "1"}
    agent = make_agent(fake, arena_streams=streams, stream_id="")
    row = {**ROW, "arena_stream_name": "a", "reward_ref_key": "grader", "reward_ref_version": "2"}
    with pytest.raises(ValueError, match="reward_ref mismatch"):
        await agent.run(row, **run_kwargs())
    assert fake.calls == []


@pytest.mark.parametrize(
    "live, message",
    [
        ({"key": "grader", "version": "2"}, "drifted before launch"),
        (None, "has no default_reward_ref"),
    ],
)
async def test_live_reward_ref_drift_stops_the_launch(fake, live, message):
    # W13
    fake.streams["stream-a"]["default_reward_ref"] = live
    streams = [
        {
            "name": "a",
            "stream_id": "stream-a",
            "expected_reward_ref": {"key": "grader", "version": "1"},
        }
    ]
    agent = make_agent(fake, arena_streams=streams, stream_id="")
    row = {**ROW, "arena_stream_name": "a", "reward_ref_key": "grader", "reward_ref_version": "1"}
    with pytest.raises(ArenaAPIError, match=message) as caught:
        await agent.run(row, **run_kwargs())
    if live:
        assert "grader@1" in str(caught.value) and "grader@2" in str(caught.value)
    assert fake.op_names() == ["stream"]
    stats = metrics()
    assert stats["rollout/arena/reward_ref_validation_success"] == 0.0
    assert "rollout/arena/call_success" not in stats


@pytest.mark.parametrize(
    "row_protocol, configured, message",
    [
        ("smoke-signals", "", "unsupported Arena LLM protocol"),
        ("responses", "anthropic", "mismatch"),
    ],
)
async def test_row_protocol_is_checked(fake, row_protocol, configured, message):
    streams = [{"name": "a", "stream_id": "stream-a", "llm_protocol": configured}]
    agent = make_agent(fake, arena_streams=streams, stream_id="")
    row = {**ROW, "arena_stream_name": "a", "llm_protocol": row_protocol}
    with pytest.raises(ValueError, match=message):
        await agent.run(row, **run_kwargs())
    assert fake.calls == []


@pytest.mark.parametrize("missing", ["stream_id", "data_id", "base_url", "api_key"])
async def test_required_arguments(fake, missing):
    agent = make_agent(fake, stream_id="")
    row, kwargs = dict(ROW), run_kwargs()
    if missing in row:
        row[missing] = ""
    else:
        kwargs[missing] = ""
    with pytest.raises(ValueError, match=f"{missing} is required for ArenaStreamAgentWorkflow"):
        await agent.run(row, **kwargs)
    assert fake.calls == []


async def test_transform_returning_nan_is_audited_without_a_training_score(fake, tmp_path):
    # W16
    fake.polls = [{"status": "DONE", "score": 0.4, "raw": {"why": "kept"}}]
    agent = make_agent(
        fake,
        arena_reward_transform_fn="tests.unit.examples.test_arena_agent_failures.not_a_number",
        arena_result_dump_dir=str(tmp_path),
    )
    with pytest.raises(ValueError, match="non-finite"):
        await agent.run(dict(ROW), **run_kwargs())
    await agent.persist_episode_result(dict(ROW), None)  # already dumped: no second record
    (record,) = records(tmp_path)
    assert record["raw"] == {"why": "kept"} and record["training_score"] is None
    assert record["arena_score"] == 0.4
    stats = metrics()
    assert stats["rollout/arena/terminal_success"] == 1.0
    assert stats["rollout/arena/result_processing_success"] == 0.0
    assert stats["rollout/arena/call_success"] == 0.0


class NumberClient(ArenaOpenAPIClient):
    """An older client whose launch returns only the score (or something unusable)."""

    answer: object = 0.5

    async def launch_one_task_result(self, *args, on_launch_success=None, **kwargs):
        on_launch_success("task-legacy")
        return self.answer


async def test_launch_may_return_a_plain_number(fake):
    client = NumberClient(
        base_url=BASE, api_token="t", transport=fake.transport, async_transport=fake.transport
    )
    agent = ArenaStreamAgentWorkflow(
        {"stream_id": "stream-a", "arena_llm_route_mode": "direct"}, arena_client=client
    )
    assert await agent.run(dict(ROW), **run_kwargs()) == 0.5
    assert agent.get_episode_metadata()["arena_task_id"] == "task-legacy"
    metrics()
    client.answer = "0.5"
    with pytest.raises(ArenaAPIError, match="not a task result or a number"):
        await agent.run(dict(ROW), **run_kwargs())
    stats = metrics()
    assert "rollout/arena/call_success" not in stats
    assert "rollout/arena/terminal_success" not in stats


# --- failure dispositions (docs/arena_training.md; the full case list is in
# test_failure_attribution.py) ---


@pytest.mark.parametrize(
    "error, overflow, interactions, expected",
    [
        # overflow alone never proves a model failure (was model_failure_zero)
        (failed("HARNESS_FAILED"), True, 1, "unknown_failure_reject"),
        (failed("HARNESS_FAILED"), True, 0, "unknown_failure_reject"),
        (failed("HARNESS_FAILED"), False, 1, "unknown_failure_reject"),
        (failed("SETUP_FAILED"), True, 1, "system_failure_reject"),
        # TIMEOUT and NO_OUTPUT are always rejected (were model_failure_zero with calls)
        (failed("TIMEOUT"), False, 1, "unknown_failure_reject"),
        (failed("TIMEOUT"), False, 0, "unknown_failure_reject"),
        (failed("NO_OUTPUT"), False, 1, "unknown_failure_reject"),
        (failed("NO_OUTPUT"), False, 0, "unknown_failure_reject"),
        (failed("CANCELLED"), False, 3, "system_failure_reject"),
        (failed("EVAL_FAILED"), False, 3, "system_failure_reject"),
        (failed("ERROR"), False, 3, "system_failure_reject"),  # was unknown_failure_reject
        (ArenaAPIError("poll returned HTTP 500"), True, 5, "system_failure_reject"),
        (TimeoutError("episode"), False, 5, "system_failure_reject"),
        (failed("HARNESS_FAILED", {"error": "harness failed"}), False, 1, "unknown_failure_reject"),
        (failed("HARNESS_FAILED", {"error": CLAUDE_TOO_LONG}), False, 1, "model_failure_zero"),
        (failed("HARNESS_FAILED", {"error": CLAUDE_TOO_LONG}), False, 0, "unknown_failure_reject"),
        (
            failed("HARNESS_FAILED", {"error": "harness: harness agent phase exited with code 1"}),
            False,
            1,
            "unknown_failure_reject",
        ),
    ],
)
def test_failure_classification(fake, error, overflow, interactions, expected):
    # W14, under the reference's rules
    agent = make_agent(fake)
    disposition = agent.classify_proxy_failure(
        error, context_overflow=overflow, interaction_count=interactions
    )
    assert disposition == expected
    assert agent.should_reject_failed_sample(error, disposition) is False  # flag off


GAMEAGENT = {"status": "ERROR", "outcome": {"code": "AGENT_MAX_TURNS_EXCEEDED"}}
RUN_FAILURE = {
    "runId": "main",
    "error": {
        "code": "RUNTIME_EXECUTION_FAILED",
        "details": {
            "runtimeFailure": {
                "code": "DSH_PUBLIC_ANSWER_MISSING",
                "reason": "public_answer_missing",
            }
        },
    },
}
NATIVE = {
    "nativeRlReceiptVersion": 1,
    "nativeExecutionHealthy": True,
    "nativeExportHealthy": True,
    "status": "ERROR",
    "trajectoryHealth": "healthy",
    "nativeStopReason": "completed",
    "nativeFailure": None,
    "runTerminals": {"main": "run.failed"},
    "exportedRunCount": 1,
    "runFailures": [RUN_FAILURE],
}
RUNNER = {
    "error": "harness: harness agent phase exited with code 1: invalid tool name",
    "harness": {"phase": "agent", "exit_code": 1, "result_status": "ERROR"},
}


@pytest.mark.parametrize(
    "error, overflow, expected",
    [
        (failed("TIMEOUT"), False, "unknown_failure_reject"),
        (failed("NO_OUTPUT"), True, "unknown_failure_reject"),
        (failed("SETUP_FAILED"), True, "system_failure_reject"),
        (failed("HARNESS_FAILED"), True, "unknown_failure_reject"),  # overflow alone is not enough
        (failed("HARNESS_FAILED", GAMEAGENT), False, "model_failure_zero"),
        (
            failed("HARNESS_FAILED", {**GAMEAGENT, "outcome": {"code": "LLM_RESPONSE_FAILED"}}),
            False,
            "unknown_failure_reject",
        ),
        (
            failed(
                "HARNESS_FAILED", {"error": "GAMEAGENT_OUTCOME_CODE=AUTONOMOUS_INCOMPLETE_NO_SHIP"}
            ),
            False,
            "model_failure_zero",
        ),
        (failed("HARNESS_FAILED", {"error": CLAUDE_TOO_LONG}), False, "model_failure_zero"),
        (
            failed("HARNESS_FAILED", {"error": CLAUDE_TOO_LONG + "\nrate limit reached"}),
            False,
            "unknown_failure_reject",
        ),
        (
            failed("HARNESS_FAILED", {"error": CLAUDE_TOO_LONG.replace(" Prompt is too long", "")}),
            True,
            "model_failure_zero",
        ),
        (
            failed("HARNESS_FAILED", {"error": CLAUDE_TOO_LONG.replace(" Prompt is too long", "")}),
            False,
            "unknown_failure_reject",
        ),
        (failed("HARNESS_FAILED", NATIVE), False, "model_failure_zero"),
        (failed("HARNESS_FAILED", {**NATIVE, "failure": "boom"}), False, "unknown_failure_reject"),
        (
            failed("HARNESS_FAILED", {**NATIVE, "trajectoryHealth": "degraded"}),
            False,
            "unknown_failure_reject",
        ),
        (failed("HARNESS_FAILED", RUNNER), True, "model_failure_zero"),
        (failed("HARNESS_FAILED", RUNNER), False, "unknown_failure_reject"),
        (failed("HARNESS_FAILED", {**NATIVE, **GAMEAGENT}), False, "unknown_failure_reject"),
        (
            failed("HARNESS_FAILED", {**GAMEAGENT, "status": "DONE"}),
            False,
            "unknown_failure_reject",
        ),
    ],
)
@pytest.mark.parametrize("flag", [False, True], ids=["flag-off", "flag-on"])
def test_reject_flag_changes_no_disposition(fake, error, overflow, expected, flag):
    # One rule set, always: reject_terminal_task_failures only decides drop versus raise
    # (it used to switch the baseline rules for these stricter ones).
    agent = make_agent(fake, flag=flag)
    assert (
        agent.classify_proxy_failure(error, context_overflow=overflow, interaction_count=2)
        == expected
    )
    assert agent.classify_proxy_failure(error, context_overflow=overflow, interaction_count=0) in (
        "system_failure_reject",
        "unknown_failure_reject",
    )


@pytest.mark.parametrize(
    "status, disposition, expected",
    [
        ("EVAL_FAILED", "system_failure_reject", True),
        ("EVAL_FAILED", "unknown_failure_reject", False),
        ("HARNESS_FAILED", "unknown_failure_reject", True),
        ("NO_OUTPUT", "unknown_failure_reject", True),
        ("TIMEOUT", "model_failure_zero", False),
        ("SETUP_FAILED", "system_failure_reject", False),
        ("ERROR", "system_failure_reject", False),
        ("eval_failed", "system_failure_reject", False),  # statuses compare exactly
    ],
)
def test_should_reject_failed_sample(fake, status, disposition, expected):
    agent = make_agent(fake, flag=True)
    assert agent.should_reject_failed_sample(failed(status), disposition) is expected
    assert agent.should_reject_failed_sample(ArenaAPIError("x"), disposition) is False
    assert make_agent(fake).should_reject_failed_sample(failed(status), disposition) is False


# --- audit of failures (9.3, 10) ---


async def test_recovered_and_rejected_failures_are_audited_once(fake, tmp_path):
    # W15
    fake.polls = [
        {"status": "HARNESS_FAILED", "score": 0.0, "raw": {"error": CLAUDE_TOO_LONG}},
    ]
    agent = make_agent(fake, arena_result_dump_dir=str(tmp_path))
    with pytest.raises(ArenaTaskFailedError) as caught:
        await agent.run(dict(ROW), **run_kwargs())
    disposition = agent.classify_proxy_failure(
        caught.value, context_overflow=False, interaction_count=2
    )
    assert disposition == "model_failure_zero"
    await agent.record_failure_disposition(dict(ROW), caught.value, disposition)
    assert records(tmp_path) == []  # audited with the final reward, not now
    await agent.persist_episode_result(dict(ROW), 0.0)
    await agent.persist_episode_result(dict(ROW), 0.0)
    (recovered,) = records(tmp_path)
    assert recovered["status"] == "HARNESS_FAILED"
    assert recovered["arena_score"] == 0.0 and recovered["training_score"] == 0.0
    assert recovered["raw"] == {"error": CLAUDE_TOO_LONG}

    fake.polls = [{"status": "SETUP_FAILED", "raw": {"error": "image pull"}}]
    with pytest.raises(ArenaTaskFailedError) as caught:
        await agent.run(dict(ROW), **run_kwargs("sess-2"))
    disposition = agent.classify_proxy_failure(
        caught.value, context_overflow=False, interaction_count=2
    )
    await agent.record_failure_disposition(dict(ROW), caught.value, disposition)
    await agent.persist_episode_result(dict(ROW), None)
    rejected = records(tmp_path)[1:]
    assert len(rejected) == 1
    assert rejected[0]["status"] == "SETUP_FAILED" and rejected[0]["training_score"] is None
    assert rejected[0]["session_id"] == "sess-2"


async def test_symlinked_dump_dir_is_refused(fake, tmp_path):
    # W17, made strict: a symlinked audit dir fails at start (no record would be kept)
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target, target_is_directory=True)
    for dump in (tmp_path / "link", tmp_path / "link" / "below"):
        with pytest.raises(ValueError, match=r"econfig\.arena_result_dump_dir .*symbolic link"):
            make_agent(fake, arena_result_dump_dir=str(dump))
        assert list(target.iterdir()) == []


async def test_symlinked_shard_is_refused(fake, tmp_path):
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("")
    shard = tmp_path / f"arena_results_{socket.gethostname()}_{os.getpid()}.jsonl"
    shard.symlink_to(elsewhere)
    agent = make_agent(fake, arena_result_dump_dir=str(tmp_path))
    await agent.persist_episode_result(dict(ROW), await agent.run(dict(ROW), **run_kwargs()))
    assert elsewhere.read_text() == ""
    assert metrics()["rollout/arena/result_dump_success"] == 0.0


async def test_unencodable_raw_is_reported_not_raised(fake, tmp_path):
    # Python's JSON parser accepts NaN, strict JSON lines cannot hold it.
    body = b'{"task_id":"task-1","status":"DONE","score":1.0,"raw":{"value":NaN}}'
    fake.script("poll", httpx.Response(200, content=body))
    agent = make_agent(fake, arena_result_dump_dir=str(tmp_path))
    reward = await agent.run(dict(ROW), **run_kwargs())
    await agent.persist_episode_result(dict(ROW), reward)
    assert records(tmp_path) == []
    assert metrics()["rollout/arena/result_dump_success"] == 0.0


# --- harness outcomes (the newer reference) ---


@pytest.mark.parametrize(
    "raw, code",
    [
        ({"outcome": {"code": "AGENT_RUN_TIMEOUT"}}, "AGENT_RUN_TIMEOUT"),
        ({"outcome_code": "WEIRD_CODE_7"}, "WEIRD_CODE_7"),
        ({"error": "x GAMEAGENT_OUTCOME_CODE=LLM_RESPONSE_FAILED\ny"}, "LLM_RESPONSE_FAILED"),
        (
            {
                "outcome_code": "LLM_RESPONSE_FAILED",
                "error": "GAMEAGENT_OUTCOME_CODE=LLM_RESPONSE_FAILED",
            },
            "LLM_RESPONSE_FAILED",
        ),
        ({"outcome_code": "A_CODE", "error": "GAMEAGENT_OUTCOME_CODE=B_CODE"}, None),
        ({"outcome_code": "A_CODE", "error": "GAMEAGENT_OUTCOME_CODE=bad-code"}, None),
        ({"error": "GAMEAGENT_OUTCOME_CODE="}, None),
        ({"error": "no markers"}, None),
        ("not a dict", None),
    ],
)
def test_harness_outcome_code(raw, code):
    assert harness_outcome_code(raw) == code


@pytest.mark.parametrize(
    "raw, bucket",
    [
        ({"outcome": {"code": "AGENT_MAX_TURNS_EXCEEDED"}}, "AGENT_MAX_TURNS_EXCEEDED"),
        ({"outcome": {"code": "WEIRD_CODE_7"}}, "OTHER"),
        ({"error": "no code at all"}, "OTHER"),
    ],
)
async def test_harness_error_metrics_use_bounded_buckets(fake, tmp_path, raw, bucket):
    fake.polls = [{"status": "HARNESS_FAILED", "score": 0.0, "raw": raw}]
    agent = make_agent(fake, arena_result_dump_dir=str(tmp_path))
    with pytest.raises(ArenaTaskFailedError) as caught:
        await agent.run(dict(ROW), **run_kwargs())
    await agent.record_failure_disposition(dict(ROW), caught.value, "model_failure_zero")
    metadata = agent.get_episode_metadata()
    await agent.persist_episode_result(dict(ROW), 0.0)
    metrics()
    agent.record_episode_metrics(dict(ROW), 0.0)

    stats = metrics()
    assert stats["rollout/harness_error"] == 1.0 and stats["rollout/harness_success"] == 0.0
    assert stats[f"rollout/harness_error/{bucket}"] == 1.0
    buckets = [k for k in stats if k.startswith("rollout/harness_error/") and "__" not in k]
    assert len(buckets) == 7 and sum(stats[k] for k in buckets) == 1.0
    assert not any("WEIRD" in k for k in stats)
    # the audit record carries the same identity as the episode metadata (newer reference).
    (record,) = records(tmp_path)
    assert metadata["arena_status"] == "HARNESS_FAILED"
    for key in ("session_id", "arena_task_id", "harness_outcome_code"):
        assert record[key] == metadata[key], key
    # the bounded bucket, never an unbounded code (metadata and audit used to carry the code)
    assert metadata["harness_outcome_code"] == bucket
