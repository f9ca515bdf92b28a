"""Rollout metrics of the Arena agent: ``arena/*`` call outcomes, episode scores, pass@k."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from areal.infra import workflow_context
from areal.utils import stats_tracker
from examples.swe.arena_agent_common import clean_text
from examples.swe.arena_failures import harness_error_metrics
from examples.swe.arena_results import SUCCESS_TASK_STATUSES, ArenaTaskResult
from examples.swe.arena_types import ArenaStreamConfig

__all__ = ["record_arena_scalars", "record_episode_scores", "record_group_pass_rates"]


def record_arena_scalars(**values: float) -> None:
    """Record ``arena/<name>`` scalars in the current scope (``rollout``/``eval-rollout``)."""
    stats_tracker.get(workflow_context.stat_scope()).scalar(
        **{f"arena/{name}": float(value) for name, value in values.items()}
    )


def _record_scoped(values: Mapping[str, float]) -> None:
    stats_tracker.get(workflow_context.stat_scope()).scalar(
        **{key: float(value) for key, value in values.items()}
    )


def _task_type(data: Mapping[str, Any]) -> str:
    value = data.get("arena_task_type")
    return value.strip() if isinstance(value, str) and value.strip() else "unknown"


def record_episode_scores(
    data: Mapping[str, Any],
    reward: float | None,
    result: ArenaTaskResult | None,
    stream: ArenaStreamConfig | None,
) -> None:
    """The training reward and the task's Harness status and Arena score (exported episodes).

    ``harness_error/<CODE>`` and ``harness_error/OTHER`` are recorded for every exported
    episode (0 unless it is a harness error), so their means are rates over all exported
    episodes.
    """
    task_type = _task_type(data)
    values: dict[str, float] = {}
    if reward is not None:
        values["training_score"] = reward
        if stream is not None:
            values[f"stream/{stream.name}/training_score"] = reward
    status = result.status if result is not None else None
    values["harness_success"] = float(status in SUCCESS_TASK_STATUSES)
    values["harness_error"] = float(status == "HARNESS_FAILED")
    values.update(harness_error_metrics(status, result.raw if result is not None else None))
    if result is not None and result.score is not None:
        score = result.score
        values.update(
            {
                "arena_score": score,
                "raw_reward": score,
                f"{task_type}/raw_reward": score,
                f"domain/{task_type}/raw_reward": score,
                "arena_raw_present": float(result.raw is not None),
                "arena_trace_present": float(bool(result.trace_id)),
                "arena_artifacts_present": float(bool(result.artifacts_uri)),
            }
        )
        if stream is not None:
            values[f"stream/{stream.name}/arena_score"] = score
        data_id = clean_text(data.get("data_id"))
        if data_id:
            # unscoped (the default tracker): one key per task, whichever the scope
            stats_tracker.get().scalar(**{f"debug/task/{data_id}/raw_reward": score})
    if reward is not None:
        values[f"{task_type}/reward"] = reward
        values[f"domain/{task_type}/reward"] = reward
    _record_scoped(values)


def record_group_pass_rates(
    data: Mapping[str, Any], stream: ArenaStreamConfig | None, passed: int, group_size: int
) -> None:
    """pass@k and the group's pass-count distribution, globally, per domain and Stream."""
    task_type = _task_type(data)
    prefixes = ["", f"domain/{task_type}/"]
    if stream is not None:
        prefixes.append(f"stream/{stream.name}/")
    values = {f"{task_type}/pass@k": float(passed > 0)}
    for prefix in prefixes:
        values[f"{prefix}pass@k"] = float(passed > 0)
        values[f"{prefix}all_correct"] = float(passed == group_size)
        values[f"{prefix}all_wrong"] = float(passed == 0)
        for count in range(group_size + 1):
            values[f"{prefix}group_pass_count_{count}_ratio"] = float(count == passed)
    for count in range(group_size + 1):
        values[f"group_pass_{count}"] = float(count == passed)
    _record_scoped(values)
