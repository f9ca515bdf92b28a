"""Built-in reward transforms (README_arena.md#rewards; case W2)."""

from __future__ import annotations

import math

import pytest

from examples.swe.reward_transforms import astra_partial_reward, identity_reward


@pytest.mark.parametrize(
    ("score", "expected"),
    # below 0.98 a tenth of the score (0.75 * 0.1 = 0.075); at or above it, full credit
    [(0.0, 0.0), (0.2, 0.02), (0.75, 0.075), (0.9799, 0.09799), (0.98, 1.0), (1.0, 1.0)],
)
def test_astra_partial_reward_default_threshold(score, expected):
    assert astra_partial_reward(score, {}) == pytest.approx(expected)


@pytest.mark.parametrize(("score", "expected"), [(0.8999, 0.08999), (0.9, 1.0), (0.95, 1.0)])
def test_astra_partial_reward_configured_threshold(score, expected):
    assert astra_partial_reward(score, {}, reward_threshold=0.9) == pytest.approx(expected)


@pytest.mark.parametrize("bad", [-0.01, 1.01, math.nan, math.inf, "0.5", True, None])
def test_scores_outside_the_unit_interval_are_rejected(bad):
    for transform in (astra_partial_reward, identity_reward):
        with pytest.raises(ValueError, match=r"within \[0, 1\]"):
            transform(bad, {})


def test_identity_reward_ignores_the_threshold():
    assert identity_reward(0.75, {}) == 0.75
    assert identity_reward(0.3, {"data_id": "x"}, reward_threshold=0.9) == 0.3
    assert identity_reward(1, {}) == 1.0 and isinstance(identity_reward(1, {}), float)
