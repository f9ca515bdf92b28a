"""Result envelopes and task types (cases T4-T6, D2)."""

from __future__ import annotations

import math

import pytest

from examples.swe.arena_client import (
    ArenaAPIError,
    ArenaOpenAPIClient,
    ArenaTaskResult,
    _arena_task_type_from_tags,
    _parse_task_result,
)
from examples.swe.arena_results import FAILED_TASK_STATUSES


def test_failed_statuses():
    # the newest reference client's set includes the grader's ERROR
    assert (
        ArenaOpenAPIClient.FAILED_TASK_STATUSES
        == FAILED_TASK_STATUSES
        == {
            "CANCELLED",
            "COLLECT_FAILED",
            "ERROR",
            "EVAL_FAILED",
            "FAILED",
            "HARNESS_FAILED",
            "NO_OUTPUT",
            "SETUP_FAILED",
            "TIMEOUT",
        }
    )


@pytest.mark.parametrize("raw", [None, {"nested": {"deep": [1, 2]}}, {"score": 9}, [1, "a", None]])
def test_raw_is_kept_verbatim(raw):  # T4
    result = _parse_task_result(
        {"task_id": "t", "status": "DONE", "score": 0.25, "raw": raw, "trace_id": "tr-1"}
    )
    assert result == ArenaTaskResult("t", "DONE", 0.25, raw, None, "tr-1", None)


@pytest.mark.parametrize(
    "payload",
    [
        0.25,
        {"data": {"status": "DONE", "score": 0.25}},
        {"result": {"output": {"status": "DONE", "score": 0.25}}},
        {"task": {"data": {"result": {"score": 0.25}}}},
    ],
)
def test_legacy_envelopes(payload):  # T5
    result = _parse_task_result(payload, fallback_task_id="t9")
    assert (result.status, result.score) == ("DONE", 0.25)
    assert result.task_id in ("t9",)


def test_bare_number_without_fallback_uses_the_placeholder():
    assert _parse_task_result(1).task_id == "launch_one_task"


def test_unwrapping_is_bounded():
    payload = {"data": {"data": {"data": {"data": {"data": {"status": "DONE", "score": 1}}}}}}
    with pytest.raises(ArenaAPIError, match="task_id"):
        _parse_task_result(payload)


def test_status_rules():
    assert _parse_task_result({"task_id": "t", "score": 1}).status == "DONE"
    assert _parse_task_result({"task_id": "t"}).status == "PENDING"
    assert _parse_task_result({"task_id": "t", "status": " running "}).status == "RUNNING"
    with pytest.raises(ArenaAPIError, match="status"):
        _parse_task_result({"status": "  "}, fallback_task_id="t")
    with pytest.raises(ArenaAPIError, match="status"):
        _parse_task_result({"raw": {}}, fallback_task_id="t")


def test_no_reward_discovery():  # T6
    result = _parse_task_result(
        {"task_id": "t", "status": "DONE", "raw": {"score": 1, "reward": 1}}
    )
    assert result.score is None


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("DONE", "JSON object or number"),
        ({"task_id": 3, "status": "DONE"}, "task_id"),
        ({"task_id": "t", "status": "DONE", "score": "1"}, "numeric or null"),
        ({"task_id": "t", "status": "DONE", "score": True}, "numeric or null"),
        ({"task_id": "t", "status": "DONE", "score": math.inf}, "finite"),
        (math.nan, "finite"),
        ({"task_id": "t", "status": "DONE", "trace_id": 5}, "trace_id"),
    ],
)
def test_envelope_errors(payload, message):
    with pytest.raises(ArenaAPIError, match=message):
        _parse_task_result(payload, fallback_task_id="f")


@pytest.mark.parametrize(
    ("tags", "expected"),
    [
        (["domain:swe"], "swe"),
        (["domain:math", "level:hard"], "math"),
        (["level:easy"], "unknown"),
        (["domain:math", "domain:swe"], "unknown"),
        (["domain:swe", "domain: swe "], "swe"),
        (["domain:swe", 1], "unknown"),
        ({"domain": "swe"}, "unknown"),
        (None, "unknown"),
        (["Domain:swe"], "unknown"),
        (["domain:   "], "unknown"),
    ],
)
def test_task_type_from_tags(tags, expected):  # D2
    assert _arena_task_type_from_tags(tags) == expected
