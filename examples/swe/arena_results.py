"""Arena task results: statuses, the result envelope, and task types from dataset tags.

The reward of a task is the envelope's top-level ``score`` and nothing else: ``raw`` is
the grader's own payload, kept for audit and never searched for a reward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FAILED_TASK_STATUSES",
    "LOCAL_STATUSES",
    "SUCCESS_TASK_STATUSES",
    "ArenaAPIError",
    "ArenaTaskFailedError",
    "ArenaTaskResult",
    "_arena_task_type_from_tags",
    "_parse_task_result",
    "normalize_status",
]

SUCCESS_TASK_STATUSES = frozenset({"DONE", "OK"})
# ERROR is a grader error: the result endpoint may report it even for a task that was DONE.
FAILED_TASK_STATUSES = frozenset(
    {
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
# Recorded in audit shards when this side gives up waiting; Arena never sends them.
LOCAL_STATUSES = frozenset({"LOCAL_WAIT_CANCELLED", "LOCAL_WAIT_TIMEOUT"})
LAUNCH_PLACEHOLDER_TASK_ID = "launch_one_task"

_CONTROL_FIELDS = ("task_id", "status", "score", "raw", "artifacts_uri", "trace_id", "computed_at")
_LEGACY_WRAPPERS = ("result", "output", "task", "data")
_MAX_UNWRAP = 4


class ArenaAPIError(RuntimeError):
    """An Arena call failed or returned something this client cannot use."""


@dataclass(frozen=True)
class ArenaTaskResult:
    """One task's result envelope; ``raw`` is opaque and never read for the reward."""

    task_id: str
    status: str
    score: float | None = None
    raw: Any = None
    artifacts_uri: str | None = None
    trace_id: str | None = None
    computed_at: str | None = None


class ArenaTaskFailedError(ArenaAPIError):
    """A task reached a failed terminal status (see ``FAILED_TASK_STATUSES``)."""

    def __init__(
        self,
        task_id: str,
        status: str,
        payload: Mapping[str, Any] | None = None,
        result: ArenaTaskResult | None = None,
    ):
        self.task_id = task_id
        self.status = status
        self.payload = dict(payload) if isinstance(payload, Mapping) else {}
        self.result = result
        self.harness_result: Any = None  # unused: the reference fetches no Harness receipt
        super().__init__(f"Arena task {task_id} ended with status {status}")


def normalize_status(status: str) -> str:
    """A status as the envelope parser stores it; the failure rules then compare exactly."""
    return status.strip().upper()


def _is_real_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional_str(payload: Mapping[str, Any], key: str) -> str | None:
    value = payload.get(key)
    if value is None or isinstance(value, str):
        return value
    raise ArenaAPIError(f"Arena result field {key!r} must be a string or null")


def _finite_score(value: Any) -> float:
    score = float(value)
    if not math.isfinite(score):
        raise ArenaAPIError(f"Arena result score must be finite, got {score!r}")
    return score


def _parse_task_result(payload: Any, *, fallback_task_id: str = "") -> ArenaTaskResult:
    """Parse a launch or poll response into an :class:`ArenaTaskResult`.

    Legacy shapes are accepted: a bare number (a finished task's score) and up to four
    levels of ``result``/``output``/``task``/``data`` wrapping around the envelope.
    """
    for depth in range(_MAX_UNWRAP + 1):
        if _is_real_number(payload):
            return ArenaTaskResult(
                task_id=fallback_task_id or LAUNCH_PLACEHOLDER_TASK_ID,
                status="DONE",
                score=_finite_score(payload),
            )
        if not isinstance(payload, Mapping):
            raise ArenaAPIError("Arena task result must be a JSON object or number")
        if depth == _MAX_UNWRAP or any(field in payload for field in _CONTROL_FIELDS):
            break
        wrapper = next((k for k in _LEGACY_WRAPPERS if k in payload), None)
        if wrapper is None:
            break
        payload = payload[wrapper]

    task_id = payload.get("task_id", fallback_task_id)
    if not isinstance(task_id, str) or not task_id:
        raise ArenaAPIError("Arena task result has no valid task_id")

    status = payload.get("status")
    if status is None and "score" in payload:
        status = "DONE"
    elif status is None and isinstance(payload.get("task_id"), str):
        status = "PENDING"
    elif isinstance(status, str) and status.strip():
        status = normalize_status(status)
    else:
        raise ArenaAPIError(f"Arena task {task_id} result is missing a valid status")

    score = payload.get("score")
    if score is not None:
        if not _is_real_number(score):
            raise ArenaAPIError(f"Arena task {task_id} score must be numeric or null")
        score = _finite_score(score)

    return ArenaTaskResult(
        task_id=task_id,
        status=status,
        score=score,
        raw=payload.get("raw"),
        artifacts_uri=_optional_str(payload, "artifacts_uri"),
        trace_id=_optional_str(payload, "trace_id"),
        computed_at=_optional_str(payload, "computed_at"),
    )


def _arena_task_type_from_tags(tags: Any) -> str:
    """The single ``domain:<type>`` tag value, else ``"unknown"`` (never an error)."""
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        return "unknown"
    domains = {t[len("domain:") :].strip() for t in tags if t.startswith("domain:")}
    domains.discard("")
    return domains.pop() if len(domains) == 1 else "unknown"
