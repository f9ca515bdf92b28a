"""Reusable reward transforms for ``reward_transform_fn`` (score in [0, 1] -> RL reward).

A transform is called as ``fn(reward, data)`` and, only when the Stream configures a
threshold, with the keyword ``reward_threshold=<threshold>``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["astra_partial_reward", "identity_reward"]


def _unit_score(reward: float) -> float:
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise ValueError(f"Arena score must be a number within [0, 1], got {reward!r}")
    value = float(reward)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"Arena score must be finite and within [0, 1], got {value!r}")
    return value


def astra_partial_reward(
    reward: float, data: Mapping[str, Any], reward_threshold: float = 0.98
) -> float:
    """Full credit at or above the threshold; a tenth of the score below it.

    ``0.75 -> 0.075`` and ``0.98 -> 1.0`` with the default threshold 0.98: partial
    solutions still rank above failures, but only a passing solution earns a full reward.
    """
    value = _unit_score(reward)
    return 1.0 if value >= reward_threshold else value * 0.1


def identity_reward(
    reward: float, data: Mapping[str, Any], reward_threshold: float | None = None
) -> float:
    """The score unchanged (validated to lie within [0, 1]); the threshold is ignored."""
    return _unit_score(reward)
