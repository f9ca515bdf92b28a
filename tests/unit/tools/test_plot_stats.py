"""plot_stats: panels from stats.jsonl, PNG output, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal.tools.plot_stats import (
    TOKENS_PER_SEC,
    PlotError,
    add_tokens_per_sec,
    load_rows,
    main,
    panel_keys,
    plot_stats,
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
        ("reward", ["rollout/reward", "ppo_actor/task_reward/avg"]),
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
