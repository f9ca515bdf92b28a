"""Evaluation during training: its own rollout controller and one pass over the valid rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from areal.api.cli_args import EvaluatorConfig, SchedulingSpec, SchedulingStrategy
from areal.infra.controller.rollout_controller import RolloutController
from areal.utils import logging

__all__ = [
    "EVAL_SCOPE",
    "eval_pass",
    "eval_stats",
    "rescope",
    "start_eval_rollout",
    "will_evaluate",
]

logger = logging.getLogger("trainer")

EVAL_SCOPE = "eval-rollout"
"""The evaluation controller's role, and the prefix of its stats."""


def will_evaluate(
    eval_workflow: Any, rows: Sequence[Any] | None, schedule: EvaluatorConfig
) -> bool:
    """Whether there is an evaluation to run: an eval workflow, valid rows, and an
    ``evaluator`` schedule that fires (no eval worker starts otherwise)."""
    if eval_workflow is None:
        return False
    if rows is None or len(rows) == 0:
        logger.warning("an eval workflow was given but no valid_dataset rows: no evaluation")
        return False
    freqs = (schedule.freq_epochs, schedule.freq_steps, schedule.freq_secs)
    if all(f is None for f in freqs) and not schedule.eval_before_train:
        logger.warning(
            "an eval workflow was given but evaluator.freq_epochs, freq_steps and "
            "freq_secs are all null (and eval_before_train is false): no evaluation"
        )
        return False
    return True


def start_eval_rollout(
    rollout: RolloutController, scheduler: Any, spec: SchedulingSpec
) -> RolloutController:
    """The evaluation controller: its own workers, forked beside ``rollout``'s, sending to
    the same servers at the same weight version.

    It has no staleness bound (``max_head_offpolicyness`` null): its rollouts are never
    trained, and it runs only while the training rollout is held by the weight-update
    barrier. The training controller's health checks cover the shared servers.
    """
    config = dataclasses.replace(
        rollout.config, max_head_offpolicyness=None, health_check_interval=0.0
    )
    controller = RolloutController(config, scheduler, role=EVAL_SCOPE)
    controller.initialize(
        len(rollout.workers),
        dataclasses.replace(spec, gpu=0),
        server_addrs=list(rollout.server_addrs),
        strategy=SchedulingStrategy(type="colocation", target="rollout", fork=True),
    )
    controller.set_version(rollout.get_version())
    return controller


def eval_pass(
    controller: RolloutController,
    rows: Sequence[Any],
    workflow: Any,
    workflow_kwargs: dict[str, Any] | None,
    n_samples: int,
    proxy_addr: str | None,
) -> Callable[[], dict[str, float]]:
    """One evaluation: every row of ``rows`` rolled out (``n_samples`` samples each,
    ``is_eval``), as a function returning the controller's stats and :func:`eval_stats`."""

    def evaluate() -> dict[str, float]:
        results = controller.rollout_batch(
            (rows[i] for i in range(len(rows))),
            workflow,
            workflow_kwargs,
            group_size=n_samples,
            is_eval=True,
            proxy_addr=proxy_addr,
        )
        stats = controller.export_stats()
        stats.update(eval_stats(results))
        return stats

    return evaluate


def eval_stats(results: list[dict | None]) -> dict[str, float]:
    """Rows evaluated and rejected, and the mean reward over every accepted sample."""
    rewards = [
        float(r)
        for trajectory in results
        if trajectory is not None and trajectory.get("rewards") is not None
        for r in trajectory["rewards"].reshape(-1)
    ]
    out = {
        f"{EVAL_SCOPE}/n_rows": float(len(results)),
        f"{EVAL_SCOPE}/n_rejected": float(sum(t is None for t in results)),
        f"{EVAL_SCOPE}/n_samples": float(len(rewards)),
    }
    if rewards:
        out[f"{EVAL_SCOPE}/reward_mean"] = sum(rewards) / len(rewards)
    return out


def rescope(stats: dict[str, float], scope: str, into: str) -> dict[str, float]:
    """``<scope>/<name>`` keys renamed ``<into>/<name>``; others unchanged."""
    prefix = scope + "/"
    return {(into + k[len(scope) :] if k.startswith(prefix) else k): v for k, v in stats.items()}
