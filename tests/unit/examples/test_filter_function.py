"""The dynamic group filter (``examples.swe.filter_function``, case F1)."""

from __future__ import annotations

import math

import pytest
import torch

from areal.utils import stats_tracker
from examples.swe.filter_function import filter_function


@pytest.fixture
def rollout_stats():
    """The ``rollout`` tracker's exported stats, starting from a clean slate."""
    tracker = stats_tracker.get("rollout")
    tracker.export()
    return lambda: tracker.export()


@pytest.mark.parametrize("rewards", [[0.0, 0.0], [1.0, 1.0], [0.1, 0.1]])
def test_rejects_groups_of_equal_rewards(rewards):
    assert filter_function({"rewards": torch.tensor(rewards)}) is False


@pytest.mark.parametrize("rewards", [[0.0, 1.0], [0.1, 0.2, 0.1], [0.999, 1.0]])
def test_accepts_mixed_groups(rewards):
    assert filter_function({"rewards": torch.tensor(rewards)}) is True


def test_reads_original_rewards_over_centered_rewards():
    # Centered rewards of a mixed group can coincide; the originals decide.
    mixed = {"rewards": torch.tensor([0.0, 0.0]), "original_rewards": torch.tensor([0.0, 1.0])}
    assert filter_function(mixed) is True
    # And centered rewards that differ do not rescue a group that was all equal.
    equal = {"rewards": torch.tensor([-0.5, 0.5]), "original_rewards": torch.tensor([1.0, 1.0])}
    assert filter_function(equal) is False


@pytest.mark.parametrize(
    ("rewards", "all_correct", "all_wrong"),
    [
        ([1.0, 1.0], 1.0, 0.0),
        ([0.999, 0.999], 1.0, 0.0),  # the solved tolerance is >= 0.999
        ([0.9989, 0.9989], 0.0, 1.0),
        ([0.0, 0.0], 0.0, 1.0),
        ([0.05, 0.05], 0.0, 1.0),  # a uniform partial score counts as all wrong
    ],
)
def test_classifies_rejections(rollout_stats, rewards, all_correct, all_wrong):
    assert filter_function({"original_rewards": rewards, "rewards": [0.0, 0.0]}) is False
    stats = rollout_stats()
    assert stats["rollout/rejected_by_failed_or_perfect"] == 1.0
    assert stats["rollout/rejected_by_all_correct"] == all_correct
    assert stats["rollout/rejected_by_all_wrong"] == all_wrong


def test_accepted_groups_record_zero_rejections(rollout_stats):
    filter_function({"rewards": [0.0, 1.0]})
    filter_function({"rewards": [1.0, 1.0]})
    stats = rollout_stats()
    # one of two groups rejected, and it was all correct
    assert stats["rollout/rejected_by_failed_or_perfect"] == 0.5
    assert stats["rollout/rejected_by_all_correct"] == 0.5
    assert stats["rollout/rejected_by_all_wrong"] == 0.0


@pytest.mark.parametrize(
    "sample",
    [{}, {"rewards": []}, {"rewards": [0.0, math.nan]}, {"original_rewards": [math.inf, 1.0]}],
    ids=["missing", "empty", "nan", "inf"],
)
def test_rejects_unusable_rewards(sample):
    with pytest.raises(ValueError, match="rewards"):
        filter_function(sample)


def test_records_through_any_tracker_with_the_plain_api(monkeypatch):
    """Only ``scalar``/``stat`` are used: a tracker object with nothing else (no scopes)
    receives the three counts, once per call, under their bare names."""

    class PlainTracker:
        def __init__(self):
            self.scalars: list[dict[str, float]] = []

        def scalar(self, **values: float) -> None:
            self.scalars.append(values)

        def stat(self, denominator: str, **values) -> None:
            raise AssertionError("the filter records scalars only")

    plain = PlainTracker()
    names: list[str] = []
    monkeypatch.setattr(stats_tracker, "get", lambda name="": names.append(name) or plain)
    assert filter_function({"rewards": torch.tensor([1.0, 1.0])}) is False
    assert filter_function({"rewards": torch.tensor([0.0, 1.0])}) is True
    assert names == ["rollout", "rollout"]
    assert plain.scalars == [
        {
            "rejected_by_failed_or_perfect": 1.0,
            "rejected_by_all_correct": 1.0,
            "rejected_by_all_wrong": 0.0,
        },
        {
            "rejected_by_failed_or_perfect": 0.0,
            "rejected_by_all_correct": 0.0,
            "rejected_by_all_wrong": 0.0,
        },
    ]
