"""Scoped statistics with hand-computed reductions."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal.utils import stats_tracker
from areal.utils.stats_tracker import ReduceType, StatsTracker


def test_scalar_scopes_and_counts():
    t = StatsTracker()
    with t.scope("rollout"):
        t.scalar(reward=1.0)
        t.scalar(reward=0.0)
        with t.scope("arena"):
            t.scalar(solved=1)
    t.scalar(step=3)
    # rollout/reward: mean(1, 0) = 0.5 over 2 records
    assert t.export() == {
        "rollout/reward": 0.5,
        "rollout/reward__count": 2.0,
        "rollout/arena/solved": 1.0,
        "rollout/arena/solved__count": 1.0,
        "step": 3.0,
        "step__count": 1.0,
    }
    assert t.export() == {}  # reset after export


def test_stat_avg_min_max_over_the_mask():
    t = StatsTracker()
    with t.scope("ppo_actor"):
        t.denominator(n_tokens=torch.tensor([True, True, False, True]))
        t.stat(denominator="n_tokens", loss=torch.tensor([1.0, 3.0, 100.0, 2.0]))
        t.denominator(n_tokens=torch.tensor([True, False]))
        t.stat(denominator="n_tokens", loss=torch.tensor([6.0, -50.0]))
    out = t.export()
    # masked values 1, 3, 2, 6: avg = 12 / 4 = 3, min 1, max 6; 4 tokens counted
    assert out == {
        "ppo_actor/loss/avg": 3.0,
        "ppo_actor/loss/min": 1.0,
        "ppo_actor/loss/max": 6.0,
        "ppo_actor/n_tokens": 4.0,
    }


def test_other_reduce_types():
    t = StatsTracker()
    t.denominator(m=torch.tensor([True, True, False]))
    t.stat(denominator="m", reduce_type=ReduceType.SUM, s=torch.tensor([1.0, 2.0, 9.0]))
    t.stat(denominator="m", reduce_type=ReduceType.MAX, x=torch.tensor([1.0, 2.0, 9.0]))
    t.stat(denominator="m", reduce_type=ReduceType.AVG, a=torch.tensor([1.0, 2.0, 9.0]))
    assert t.export() == {"m": 2.0, "s": 3.0, "x": 2.0, "a": 1.5}


def test_recording_errors():
    t = StatsTracker()
    with pytest.raises(ValueError, match="recorded before"):
        t.stat(denominator="missing", x=torch.ones(2))
    t.denominator(m=torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        t.stat(denominator="m", x=torch.ones(3))
    with pytest.raises(TypeError, match="bool tensor"):
        t.denominator(bad=torch.ones(2))
    t.scalar(k=1.0)
    with pytest.raises(ValueError, match="was recorded as scalar"):
        t.denominator(k=torch.ones(1, dtype=torch.bool))


def test_export_selects_a_prefix_and_keeps_the_rest():
    t = StatsTracker()
    with t.scope("rollout"):
        t.scalar(reward=1.0)
    t.scalar(other=2.0)
    assert t.export(key="rollout") == {"rollout/reward": 1.0, "rollout/reward__count": 1.0}
    assert t.export() == {"other": 2.0, "other__count": 1.0}


def test_record_timing_and_decorator_scope():
    t = StatsTracker()

    @t.scope("outer")
    def work():
        with t.record_timing("step"):
            t.scalar(x=1.0)

    work()
    out = t.export()
    assert out["outer/x"] == 1.0
    assert out["timeperf/step"] >= 0.0 and out["timeperf/step__count"] == 1.0


async def test_scopes_are_per_task():
    t = StatsTracker()

    async def agent(name: str, value: float) -> None:
        with t.scope(name):
            await asyncio.sleep(0.01)
            t.scalar(reward=value)

    @t.scope("eval-rollout")
    async def scoped() -> None:
        await asyncio.sleep(0)
        t.scalar(reward=5.0)

    await asyncio.gather(agent("a", 1.0), agent("b", 0.0), scoped())
    out = t.export()
    assert out["a/reward"] == 1.0 and out["b/reward"] == 0.0 and out["eval-rollout/reward"] == 5.0


def test_named_trackers_and_module_functions():
    stats_tracker.get("unit-named").scalar(v=2.0)
    with stats_tracker.scope("unit-default"):
        stats_tracker.scalar(v=4.0)
    out = stats_tracker.export_all()
    assert out["unit-named/v"] == 2.0 and out["unit-default/v"] == 4.0
    assert "v" not in out
    assert stats_tracker.get("unit-named") is stats_tracker.get("unit-named")


def test_a_named_tracker_records_under_its_name():
    """``get(name)`` prefixes every key with ``name/``: scalars, denominators and stats,
    scopes inside it, timings; the scope stack adds after the name."""
    tracker = stats_tracker.get("unit-rollout")
    tracker.export()
    tracker.scalar(reward=1.0)
    with tracker.scope("agent"):
        tracker.denominator(n=torch.tensor([True, False]))
        tracker.stat(denominator="n", turns=torch.tensor([3.0, 9.0]))
    with tracker.record_timing("step"):
        pass
    out = tracker.export()
    assert out["unit-rollout/reward"] == 1.0
    assert out["unit-rollout/agent/n"] == 1.0
    assert out["unit-rollout/agent/turns/avg"] == 3.0
    assert "unit-rollout/timeperf/step" in out
    assert not [k for k in out if not k.startswith("unit-rollout/")]
    assert (
        stats_tracker.StatsTracker("/x/").export() == {}
        and stats_tracker.StatsTracker("/x/").name == "x"
    )


def test_export_all_gathers_every_named_tracker_mergeable():
    stats_tracker.export_all()
    stats_tracker.get("rollout").scalar(reward=1.0)
    stats_tracker.get("eval-rollout").scalar(reward=0.5)
    stats_tracker.get("my-workflow").scalar(custom=2.0)
    out = stats_tracker.export_all(mergeable=True)
    assert out["rollout/reward"] == 1.0 and out["rollout/reward__count"] == 1.0
    assert out["eval-rollout/reward"] == 0.5
    assert out["my-workflow/custom"] == 2.0
    assert stats_tracker.export_all() == {}  # reset


def test_worker_exports_merge_denominators_and_masked_averages():
    """Two rollout workers' turn counts: denominators add up, averages weigh by the counted
    samples (not by the workers), extremes are taken over both, untagged keys are dropped."""
    exports = []
    for turns, harness_error in (([2.0, 4.0], [False, True]), ([3.0], [False])):
        t = stats_tracker.StatsTracker()
        for value, error in zip(turns, harness_error, strict=True):
            t.denominator(n_count=torch.tensor([True]), ok_count=torch.tensor([not error]))
            t.stat(denominator="n_count", n=torch.tensor([value]))
            t.stat(denominator="ok_count", ok=torch.tensor([value]))
        t.scalar(reward=sum(turns))
        exports.append({**t.export(mergeable=True), "untagged": 1.0})
    merged = stats_tracker.merge_exports(exports)
    assert merged == {
        "n_count": 3.0,
        "n/avg": 3.0,
        "n/min": 2.0,
        "n/max": 4.0,
        "ok_count": 2.0,
        "ok/avg": 2.5,
        "ok/min": 2.0,
        "ok/max": 3.0,
        "reward": 4.5,
    }
    # a plain export carries no merge tags besides the scalars' counts
    t = stats_tracker.StatsTracker()
    t.denominator(c=torch.tensor([True]))
    t.stat(denominator="c", v=torch.tensor([1.0]))
    assert set(t.export()) == {"c", "v/avg", "v/min", "v/max"}
