"""A rollout worker's stats export: every named tracker reaches the trainer."""

from __future__ import annotations

import httpx
import pytest

from areal.engine.remote.stats import worker_stats
from areal.infra import workflow_context
from areal.infra.controller.rollout_controller import merge_worker_stats
from areal.utils import stats_tracker


@pytest.fixture(autouse=True)
def clean_trackers():
    stats_tracker.export_all()
    yield
    stats_tracker.export_all()


def one_worker(reward: float, custom: float, eval_reward: float) -> dict[str, float]:
    """What a worker records in three trackers, exported as the worker exports it."""
    stats_tracker.get("rollout").scalar(reward=reward)
    with workflow_context.scoped(is_eval=True):
        stats_tracker.get(workflow_context.stat_scope()).scalar(reward=eval_reward)
    stats_tracker.get("my-workflow").scalar(custom=custom)
    with httpx.Client() as http:
        return worker_stats(http, [], "admin-key")


def test_every_named_tracker_of_a_worker_reaches_the_merged_stats():
    workers = [one_worker(1.0, 2.0, 0.0), one_worker(0.0, 4.0, 1.0)]
    assert workers[0]["my-workflow/custom__count"] == 1.0
    merged = merge_worker_stats(workers)
    assert merged["rollout/reward"] == 0.5
    assert merged["eval-rollout/reward"] == 0.5
    assert merged["my-workflow/custom"] == 3.0
    # the names are not doubled by the trackers' own prefix
    assert not any(
        key.startswith(("rollout/rollout/", "eval-rollout/eval-rollout/")) for key in merged
    )
