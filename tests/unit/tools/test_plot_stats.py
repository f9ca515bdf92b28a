"""plot_stats: panels from stats.jsonl, PNG output, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal.tools.plot_stats import (
    TOKENS_PER_SEC,
    PlotError,
    add_tokens_per_sec,
    default_window,
    eval_points,
    load_rows,
    main,
    moving_average,
    panel_keys,
    plot_stats,
    reward_key,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_stats(directory: Path, rows: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "stats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _training_rows() -> list[dict]:
    return [
        {
            "epoch": 0,
            "step": g,
            "global_step": g,
            "time": 100.0 + 10 * g,
            "rollout/reward": 0.1 * g,
            "ppo_actor/task_reward/avg": 0.1 * g,
            "ppo_actor/task_reward/min": 0.0,
            "ppo_actor/update/actor_loss": -0.01 * g,
            "ppo_actor/update/entropy/avg": 1.0 - 0.05 * g,
            "ppo_actor/n_valid_tokens": 500.0,
            "timeperf/rollout": 8.0,
            "timeperf/train_step": 2.0,
        }
        for g in range(5)
    ]


def test_main_writes_png(tmp_path, capsys):
    _write_stats(tmp_path / "run", _training_rows())
    out = tmp_path / "curves.png"
    assert main([str(tmp_path / "run"), "-o", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert f"wrote {out}" in capsys.readouterr().out


def test_default_output_is_next_to_the_stats(tmp_path):
    stats = _write_stats(tmp_path, _training_rows())
    assert main([str(stats)]) == 0
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG_MAGIC)


def test_panels_pick_keys_by_name():
    rows = _training_rows()
    keys = [k for k in rows[0] if k not in ("epoch", "step", "global_step", "time")]
    assert panel_keys([*keys, TOKENS_PER_SEC]) == [
        ("loss", ["ppo_actor/update/actor_loss"]),
        ("entropy", ["ppo_actor/update/entropy/avg"]),
        ("throughput", [TOKENS_PER_SEC]),
        ("step time (s)", ["timeperf/rollout", "timeperf/train_step"]),
    ]


def test_tokens_per_sec_uses_time_between_consecutive_steps():
    rows = [
        {"global_step": 0, "time": 100.0, "ppo_actor/n_valid_tokens": 400.0},
        {"global_step": 1, "time": 110.0, "ppo_actor/n_valid_tokens": 500.0},
        {"global_step": 3, "time": 900.0, "ppo_actor/n_valid_tokens": 500.0},  # step 2 missing
    ]
    add_tokens_per_sec(rows)
    # step 1: 500 tokens over 110 - 100 = 10 s = 50 tok/s; steps 0 and 3 have no predecessor
    assert [r.get(TOKENS_PER_SEC) for r in rows] == [None, 50.0, None]


def test_rows_are_deduplicated_by_step_last_wins(tmp_path):
    rows = [
        {"global_step": 0, "x": 1.0},
        {"global_step": 1, "x": 2.0},
        {"global_step": 1, "x": 3.0},  # replayed after a recover
    ]
    _write_stats(tmp_path, rows)
    assert [r["x"] for r in load_rows(tmp_path)] == [1.0, 3.0]


def test_missing_file_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no stats.jsonl" in capsys.readouterr().err


def test_no_numeric_keys_is_a_clear_error(tmp_path):
    _write_stats(tmp_path, [{"epoch": 0, "step": 0, "global_step": 0, "note": "text"}])
    with pytest.raises(PlotError, match="no numeric statistics"):
        plot_stats(tmp_path, tmp_path / "out.png")


def test_unmatched_keys_fall_back_to_one_panel(tmp_path):
    _write_stats(tmp_path, [{"global_step": g, "custom/metric": float(g)} for g in range(3)])
    out = plot_stats(tmp_path, tmp_path / "out.png")
    assert out.read_bytes().startswith(PNG_MAGIC)


# --- the reward panel ---


def test_the_reward_panel_draws_one_training_series_the_batch_mean_first():
    keys = ["rollout/reward", "ppo_actor/task_reward/avg", "rollout/reward_mean"]
    assert reward_key(keys) == "rollout/reward_mean"
    assert reward_key(["ppo_actor/task_reward/avg", "rollout/reward"]) == "rollout/reward"
    assert reward_key(["ppo_actor/update/actor_loss"]) is None


def test_moving_average_is_trailing_and_uses_fewer_points_at_the_start():
    # window 3 over [0, 3, 6, 3]: 0/1, (0+3)/2, (0+3+6)/3, (3+6+3)/3
    assert moving_average([0.0, 3.0, 6.0, 3.0], 3) == [0.0, 1.5, 3.0, 4.0]
    assert moving_average([], 3) == []
    with pytest.raises(ValueError, match="window"):
        moving_average([1.0], 0)


def test_default_window_is_a_quarter_of_the_run_within_2_and_10():
    assert [default_window(n) for n in (3, 16, 40, 400)] == [2, 4, 10, 10]


def test_eval_points_put_the_before_training_score_at_step_0():
    rows = [
        {
            "global_step": 0,
            "eval-rollout/before_train/reward_mean": 0.2,
            "rollout/reward_mean": 0.3,
        },
        {"global_step": 1, "rollout/reward_mean": 0.4},
        {"global_step": 2, "eval-rollout/reward_mean": 0.7},  # evaluated after step 3
    ]
    assert eval_points(rows) == [(0, 0.2), (3, 0.7)]


def test_a_run_with_evaluation_plots(tmp_path):
    rows = _training_rows()
    for row in rows:
        row["rollout/reward_mean"] = row["rollout/reward"]
    rows[0]["eval-rollout/before_train/reward_mean"] = 0.1
    rows[-1]["eval-rollout/reward_mean"] = 0.5
    _write_stats(tmp_path, rows)
    out = plot_stats(tmp_path, tmp_path / "out.png", window=2)
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert main([str(tmp_path), "--window", "3"]) == 0
    alone = plot_stats(tmp_path, tmp_path / "reward.png", reward_only=True)
    assert alone.read_bytes().startswith(PNG_MAGIC)


def test_reward_only_without_a_reward_is_a_clear_error(tmp_path):
    _write_stats(tmp_path, [{"global_step": 0, "ppo_actor/update/actor_loss": 0.1}])
    with pytest.raises(PlotError, match="no reward"):
        plot_stats(tmp_path, tmp_path / "out.png", reward_only=True)
