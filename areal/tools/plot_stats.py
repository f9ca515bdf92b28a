"""Plot training curves from a run's ``stats.jsonl``: ``python -m areal.tools.plot_stats LOGDIR``.

The x axis is the step number as the log and the demo's summary count it: ``global_step +
1`` (step 1 is the first trained step; an evaluation before training sits at step 0).

Panels, each drawn only when its keys are present:

* reward (first, always one series): the training reward of each step, the first of
  :data:`REWARD_KEYS` present (the trained batch's mean Arena score, ``rollout/reward_mean``,
  before the others), as light points with a trailing moving average drawn over them; and
  the held-out evaluation reward (``eval-rollout/reward_mean``, and
  ``eval-rollout/before_train/reward_mean`` at step 0) as large markers;
* loss: keys containing ``loss`` (e.g. ``ppo_actor/update/actor_loss``);
* entropy: keys containing ``entropy`` (e.g. ``ppo_actor/update/entropy/avg``);
* throughput: keys containing ``throughput``, plus generated tokens per second computed as
  ``ppo_actor/n_valid_tokens`` over the wall time between consecutive steps' rows;
* step time: ``timeperf/*`` keys (seconds per phase), the slowest phases.

``…/min`` and ``…/max`` companions, per-task ``debug/`` and evaluation keys are left out of
the other panels, and each shows at most four keys (the least nested first; the slowest
phases for step time), to keep them readable. When a resumed run logged a step twice, its
last row wins. If no key fits a panel, up to eight numeric keys are drawn in one panel
instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; must come before pyplot is imported
import matplotlib.pyplot as plt

__all__ = [
    "EVAL_BEFORE_KEY",
    "EVAL_KEY",
    "REWARD_KEYS",
    "PlotError",
    "add_tokens_per_sec",
    "default_window",
    "eval_points",
    "load_rows",
    "main",
    "moving_average",
    "panel_keys",
    "plot_stats",
    "reward_key",
]

STATS_FILE = "stats.jsonl"
TOKEN_KEY = "ppo_actor/n_valid_tokens"
TOKENS_PER_SEC = "tokens/s (derived)"
REWARD_KEYS = ("rollout/reward_mean", "rollout/reward", "ppo_actor/task_reward/avg")
"""Training reward keys, most preferred first; the reward panel draws the first present."""
EVAL_KEY = "eval-rollout/reward_mean"
EVAL_BEFORE_KEY = "eval-rollout/before_train/reward_mean"
_META_KEYS = frozenset({"epoch", "step", "global_step", "time"})
_FALLBACK_KEYS = 8
_MAX_KEYS_PER_PANEL = 4
STEP_TIME = "step time (s)"


class PlotError(RuntimeError):
    """The stats file is missing or holds nothing to plot."""


def _stats_file(path: Path) -> Path:
    file = path / STATS_FILE if path.is_dir() else path
    if not file.is_file():
        raise PlotError(f"no {STATS_FILE} at {file} (pass the run's log directory or the file)")
    return file


def load_rows(path: str | Path) -> list[dict[str, float]]:
    """Rows of ``stats.jsonl`` ordered by ``global_step`` (the last row of a step wins)."""
    file = _stats_file(Path(path))
    by_step: dict[int, dict[str, float]] = {}
    for lineno, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PlotError(f"{file}:{lineno}: not JSON ({e.msg})") from e
        if "global_step" not in row:
            raise PlotError(f"{file}:{lineno}: row has no global_step")
        by_step[int(row["global_step"])] = row
    return [by_step[k] for k in sorted(by_step)]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _numeric_keys(rows: list[dict[str, float]]) -> list[str]:
    keys: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if _is_number(value) and key not in _META_KEYS:
                keys[key] = None
    return list(keys)


def add_tokens_per_sec(rows: list[dict[str, float]]) -> None:
    """Add ``TOKENS_PER_SEC`` to each row that directly follows the previous step's row."""
    for prev, row in itertools.pairwise(rows):
        consecutive = row["global_step"] == prev["global_step"] + 1
        secs = row.get("time", 0) - prev.get("time", 0)
        tokens = row.get(TOKEN_KEY)
        if consecutive and secs > 0 and isinstance(tokens, (int, float)):
            row[TOKENS_PER_SEC] = tokens / secs


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean of ``values`` over ``window`` points (fewer at the start)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def default_window(n_points: int) -> int:
    """A moving-average window that smooths without lagging much: a quarter of the run,
    between 2 and 10 steps."""
    return max(2, min(10, n_points // 4))


def reward_key(keys: Sequence[str]) -> str | None:
    """The training reward key the reward panel draws: the first of ``REWARD_KEYS`` present."""
    return next((k for k in REWARD_KEYS if k in keys), None)


def eval_points(rows: list[dict[str, float]]) -> list[tuple[int, float]]:
    """Held-out evaluation rewards as ``(step, reward)``: step 0 before training, else the
    step after which the evaluation ran."""
    points = []
    for row in rows:
        if _is_number(row.get(EVAL_BEFORE_KEY)):
            points.append((0, float(row[EVAL_BEFORE_KEY])))
        if _is_number(row.get(EVAL_KEY)):
            points.append((int(row["global_step"]) + 1, float(row[EVAL_KEY])))
    return points


def panel_keys(keys: list[str]) -> list[tuple[str, list[str]]]:
    """``(title, keys)`` of each non-empty panel after the reward panel, in drawing order.

    Per-task ``debug/`` keys and evaluation keys are left out, and a panel keeps at most
    ``_MAX_KEYS_PER_PANEL`` keys, the least nested first.
    """

    def pick(test: Callable[[str], bool]) -> list[str]:
        chosen = [
            k
            for k in keys
            if test(k)
            and not k.endswith(("/min", "/max"))
            and not k.startswith(("debug/", "eval-rollout/"))
        ]
        ranked = sorted(chosen, key=lambda k: (k.count("/"), chosen.index(k)))
        kept = set(ranked[:_MAX_KEYS_PER_PANEL])
        return [k for k in chosen if k in kept]

    panels = [
        ("loss", pick(lambda k: "loss" in k and "n_valid" not in k)),
        ("entropy", pick(lambda k: "entropy" in k)),
        ("throughput", pick(lambda k: "throughput" in k or k == TOKENS_PER_SEC)),
        # every phase here; plot_stats draws the slowest ones
        (STEP_TIME, [k for k in keys if k.startswith("timeperf/")]),
    ]
    return [(title, ks) for title, ks in panels if ks]


def _largest(rows: list[dict[str, float]], keys: list[str]) -> list[str]:
    """The ``_MAX_KEYS_PER_PANEL`` keys of ``keys`` with the largest mean, in key order."""

    def mean(key: str) -> float:
        values = _series(rows, key)[1]
        return sum(values) / len(values) if values else 0.0

    kept = set(sorted(keys, key=mean, reverse=True)[:_MAX_KEYS_PER_PANEL])
    return [k for k in keys if k in kept]


def _series(rows: list[dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["global_step"]) + 1, float(r[key])) for r in rows if _is_number(r.get(key))]
    return [p[0] for p in points], [p[1] for p in points]


def _draw_reward(ax, rows: list[dict[str, float]], key: str | None, window: int | None) -> None:
    if key is not None:
        xs, ys = _series(rows, key)
        w = window or default_window(len(ys))
        ax.plot(xs, ys, marker=".", linewidth=0.8, alpha=0.35, label=f"training ({key})")
        ax.plot(xs, moving_average(ys, w), linewidth=2.2, label=f"moving average ({w} steps)")
    held_out = eval_points(rows)
    if held_out:
        ex, ey = zip(*held_out)
        ax.plot(ex, ey, marker="D", markersize=8, linestyle="--", label=f"held-out ({EVAL_KEY})")
        for x, y in held_out:
            ax.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(6, 6))
    ax.set_title("reward")
    ax.set_ylabel("mean Arena score")
    ax.margins(y=0.15)  # room for the score labels


def plot_stats(
    path: str | Path, output: str | Path, *, window: int | None = None, reward_only: bool = False
) -> Path:
    """Draw the panels of the module docstring from ``path`` into the PNG ``output``.

    ``window`` is the moving average's width in steps (default :func:`default_window`);
    ``reward_only`` draws the reward panel alone.
    """
    rows = load_rows(path)
    keys = _numeric_keys(rows)
    if not keys:
        raise PlotError(f"{_stats_file(Path(path))} has no numeric statistics to plot")
    add_tokens_per_sec(rows)
    keys = _numeric_keys(rows)
    reward = reward_key(keys)
    has_reward = reward is not None or bool(eval_points(rows))
    panels = [(t, _largest(rows, ks) if t == STEP_TIME else ks) for t, ks in panel_keys(keys)]
    if reward_only:
        if not has_reward:
            raise PlotError(f"{_stats_file(Path(path))} has no reward to plot")
        panels = []
    if not panels and not has_reward:
        panels = [("stats", keys[:_FALLBACK_KEYS])]
    count = len(panels) + has_reward
    heights = [3.6] * has_reward + [2.4] * len(panels)
    fig, axes = plt.subplots(
        count, 1, figsize=(9, sum(heights)), squeeze=False, height_ratios=heights
    )
    axes = list(axes[:, 0])
    if has_reward:
        _draw_reward(axes[0], rows, reward, window)
    for ax, (title, keys_in_panel) in zip(axes[has_reward:], panels, strict=True):
        for key in keys_in_panel:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=key)
        ax.set_title(title)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="best")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.tools.plot_stats",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("logdir", type=Path, help=f"run log directory, or its {STATS_FILE}")
    parser.add_argument(
        "-o", "--output", type=Path, help="PNG to write (default: <logdir>/curves.png)"
    )
    parser.add_argument(
        "--window", type=int, default=None, help="moving-average width in steps (default: auto)"
    )
    parser.add_argument("--reward-only", action="store_true", help="draw the reward panel alone")
    args = parser.parse_args(argv)
    if args.window is not None and args.window < 1:
        parser.error("--window must be >= 1")
    base = args.logdir if args.logdir.is_dir() else args.logdir.parent
    output = args.output or base / "curves.png"
    try:
        written = plot_stats(args.logdir, output, window=args.window, reward_only=args.reward_only)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
