"""Dynamic group filter: drop groups whose rewards are all equal (no learning signal).

Use it with ``should_accept_fn: examples.swe.filter_function.filter_function``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from areal.utils import stats_tracker

__all__ = ["ALL_CORRECT_THRESHOLD", "filter_function"]

# A reward at or above this counts as solved when a rejected group is classified.
ALL_CORRECT_THRESHOLD = 0.999


def _group_rewards(sample: Mapping[str, Any]) -> list[float]:
    """The pre-normalization rewards of a group (``original_rewards``, else ``rewards``)."""
    values = sample.get("original_rewards")
    if values is None:
        values = sample.get("rewards")
    if values is None:
        raise ValueError("the group has neither 'original_rewards' nor 'rewards'")
    rewards = torch.as_tensor(values, dtype=torch.float64).reshape(-1).tolist()
    if not rewards:
        raise ValueError("the group has no rewards")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"the group has non-finite rewards: {rewards}")
    return rewards


def filter_function(sample: Mapping[str, Any]) -> bool:
    """Accept a group unless all its rewards are equal.

    Group-normalized advantages are ``r - mean(r)``: a group of equal rewards (all
    solved, all failed, or the same partial score) contributes nothing but cost. The
    ``original_rewards`` are read when present because ``rewards`` may already be
    centered, which would hide the difference between all-correct and all-wrong.

    Records, in the ``rollout`` tracker (keys ``rollout/<name>``):
    ``rejected_by_failed_or_perfect`` (1 if rejected), ``rejected_by_all_correct``
    (rejected with every reward >= 0.999) and ``rejected_by_all_wrong`` (rejected
    otherwise, including uniform partial rewards).
    """
    rewards = _group_rewards(sample)
    rejected = all(r == rewards[0] for r in rewards)
    all_correct = rejected and all(r >= ALL_CORRECT_THRESHOLD for r in rewards)
    # only ``scalar``: any tracker object providing the plain recording API will do
    stats_tracker.get("rollout").scalar(
        rejected_by_failed_or_perfect=float(rejected),
        rejected_by_all_correct=float(all_correct),
        rejected_by_all_wrong=float(rejected and not all_correct),
    )
    return not rejected
