"""``make demo``: its schedule, profile, held-out Stream and summary (without training)."""

from __future__ import annotations

import getpass
import json

import pytest

from areal.api.cli_args import load_expr_config
from examples.swe import demo
from examples.swe.demo import EXPERIMENT, Schedule, held_out_scores, schedule_for, summarize
from examples.swe.local_arena.catalog import DEFAULT_CATALOG, load_catalog
from examples.swe.local_arena.types import Ref
from examples.swe.utils import SWEPPOConfig

# --- the schedule ---


def test_a_short_run_is_one_epoch_of_exactly_its_steps():
    # 16 steps x 2 prompts = 32 of the 40 rows: one epoch of 16 steps
    schedule = Schedule(steps=16, batch_size=2, rows=40)
    assert (schedule.steps_per_epoch, schedule.epochs) == (16, 1)
    assert schedule.overrides() == [
        "total_train_steps=16",
        "total_train_epochs=1",
        "econfig.arena_mixture_epoch_size=32",
        "evaluator.freq_steps=16",
    ]


def test_a_long_run_spans_epochs_of_every_row():
    # 30 steps x 2 prompts over 40 rows: epochs of 20 steps, the second one cut at step 30
    schedule = Schedule(steps=30, batch_size=2, rows=40)
    assert (schedule.steps_per_epoch, schedule.epochs) == (20, 2)
    assert "econfig.arena_mixture_epoch_size=40" in schedule.overrides()


def test_schedule_reads_the_batch_size_from_the_profile_or_an_override():
    assert schedule_for(5, []).batch_size == 2
    assert schedule_for(5, ["train_dataset.batch_size=4"]).batch_size == 4
    assert schedule_for(5, []).rows == len(load_catalog(DEFAULT_CATALOG).rows("arith-long"))
    with pytest.raises(SystemExit, match="must be >= 1"):
        schedule_for(0, [])


def test_demo_steps_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("DEMO_STEPS", raising=False)
    assert demo.default_steps() == demo.DEFAULT_STEPS
    monkeypatch.setenv("DEMO_STEPS", "40")
    assert demo.default_steps() == 40
    monkeypatch.setenv("DEMO_STEPS", "many")
    with pytest.raises(SystemExit, match="DEMO_STEPS must be a whole number"):
        demo.default_steps()


# --- the profile and its Streams ---


@pytest.fixture
def demo_config(monkeypatch, tmp_path):
    monkeypatch.setenv("MODEL_PATH", str(tmp_path / "model"))
    monkeypatch.setenv("SWE_RL_ADMIN_API_KEY", "k" * 24)
    monkeypatch.setenv("AREAL_FILEROOT", str(tmp_path))
    args = ["--config", str(demo.PROFILE), *Schedule(16, 2, 40).overrides()]
    config, _ = load_expr_config(args, SWEPPOConfig)
    return config


def test_the_demo_profile_evaluates_a_held_out_stream_before_and_after(demo_config):
    from areal.api.config.support import unsupported

    cfg = demo_config
    assert unsupported(cfg) == []
    assert cfg.evaluator.eval_before_train and cfg.evaluator.freq_steps == 16
    assert cfg.actor.kl_ctl == 0  # no reference model copy on two cores
    assert cfg.eval_gconfig.n_samples == 1
    (train,) = cfg.econfig.arena_streams
    (held_out,) = cfg.econfig.arena_eval_streams
    assert train.stream_id != held_out.stream_id and train.name != held_out.name
    catalog = load_catalog(DEFAULT_CATALOG)
    assert catalog.harness(Ref.parse(held_out.harness)).options["temperature"] == 0
    trained, evaluated = catalog.streams[train.stream_id], catalog.streams[held_out.stream_id]
    assert evaluated.default_reward == trained.default_reward  # the same task, scored alike
    assert evaluated.default_harness == trained.default_harness


def test_held_out_rows_share_nothing_with_training_rows():
    catalog = load_catalog(DEFAULT_CATALOG)
    train = catalog.rows("arith-long")
    held_out = catalog.rows("arith-long-heldout")
    assert len(held_out) >= 16
    assert not {r.data_id for r in train} & {r.data_id for r in held_out}
    assert not {r.prompt for r in train} & {r.prompt for r in held_out}


def test_the_greedy_harness_is_the_training_harness_at_temperature_0():
    catalog = load_catalog(DEFAULT_CATALOG)
    by_key = {h.key: h for h in catalog.harnesses.values()}
    sampled, greedy = by_key["answer-chat-64"], by_key["answer-chat-64-greedy"]
    assert greedy.options == {**sampled.options, "temperature": 0}
    assert greedy.protocol == sampled.protocol and greedy.kind == sampled.kind


# --- the summary ---


def _write_run(root, stats, audit):
    log_dir = root / "logs" / getpass.getuser() / EXPERIMENT / "demo"
    log_dir.mkdir(parents=True)
    (log_dir / "stats.jsonl").write_text("".join(json.dumps(s) + "\n" for s in stats))
    shards = root / EXPERIMENT / "demo" / "arena_results"
    shards.mkdir(parents=True)
    (shards / "arena_results_h_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in audit))


def _record(stream, data_id, score, answer, at):
    return {
        "arena_stream_name": stream,
        "data_id": data_id,
        "status": "DONE",
        "arena_score": score,
        "raw": {"answer": answer},
        "computed_at": at,
    }


STATS = [
    {
        "global_step": 0,
        "rollout/reward": 0.9,  # what the workers saw; not the reward the summary shows
        "rollout/reward_mean": 0.25,
        "eval-rollout/before_train/reward_mean": 0.1,
        "ppo_actor/n_valid_tokens": 1000.0,
        "perf/step_seconds": 20.0,
    },
    {
        "global_step": 1,
        "rollout/reward_mean": 0.5,
        "eval-rollout/reward_mean": 0.6,
        "eval-rollout/n_rows": 16.0,
        "perf/step_seconds": 25.0,
    },
]


def test_held_out_scores_are_before_the_first_step_and_at_the_last_evaluation():
    assert held_out_scores(STATS) == (0.1, 0.6)
    assert held_out_scores([{"global_step": 0}]) == (None, None)


def test_the_summary_uses_one_reward_and_shows_before_and_after(tmp_path):
    audit = [
        _record("long-heldout", "h1", 0.1, "Four.", "2026-01-01T00:00:01"),
        _record("long", "t1", 0.3, "x", "2026-01-01T00:00:02"),
        _record("long-heldout", "h1", 0.7, "The answer is four because ...", "2026-01-01T00:09"),
    ]
    _write_run(tmp_path, STATS, audit)
    text = summarize(tmp_path, "demo", 600.0, "long-heldout")
    steps = text.split("\n\n")[0].splitlines()
    # step, reward (rollout/reward_mean), held-out, tokens/s (1000 / 20), step seconds
    assert steps[-2].split() == ["1", "0.250", "50", "20.00"]
    assert steps[-1].split() == ["2", "0.500", "0.600", "-", "25.00"]
    assert "0.900" not in text
    assert "Stream long-heldout, temperature 0, 16 rows" in text
    assert "0.100" in text and "0.600" in text and "0.500" in text
    assert "0.10: Four." in text and "0.70: The answer is four because ..." in text
    assert "held-out score 0.100 -> 0.600 (+0.500): improved" in text
    assert "demo finished in 10.0 min" in text
