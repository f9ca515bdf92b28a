"""Plot training curves from a run's ``stats.jsonl``: ``python -m areal.tools.plot_stats LOGDIR``.

Panels (x axis: ``global_step``), each drawn only when its keys are present:

* reward: keys containing ``reward`` (e.g. ``rollout/reward``, ``ppo_actor/task_reward/avg``);
* loss: keys containing ``loss`` (e.g. ``ppo_actor/update/actor_loss``);
* entropy: keys containing ``entropy`` (e.g. ``ppo_actor/update/entropy/avg``);
* throughput: keys containing ``throughput``, plus generated tokens per second computed as
  ``ppo_actor/n_valid_tokens`` over the wall time between consecutive steps' rows;
* step time: ``timeperf/*`` keys (seconds per phase).

``…/min`` and ``…/max`` companions and per-task ``debug/`` keys are left out, and a panel
shows at most eight keys (the least nested first), to keep panels readable. When a resumed
run logged a step twice, its last row wins. If no key fits a panel, up to eight numeric
keys are drawn in one panel instead.
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

__all__ = ["PlotError", "add_tokens_per_sec", "load_rows", "main", "panel_keys", "plot_stats"]

STATS_FILE = "stats.jsonl"
TOKEN_KEY = "ppo_actor/n_valid_tokens"
TOKENS_PER_SEC = "tokens/s (derived)"
_META_KEYS = frozenset({"epoch", "step", "global_step", "time"})
_FALLBACK_KEYS = 8
_MAX_KEYS_PER_PANEL = 8


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


def _numeric_keys(rows: list[dict[str, float]]) -> list[str]:
    keys: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if numeric and key not in _META_KEYS:
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


def panel_keys(keys: list[str]) -> list[tuple[str, list[str]]]:
    """``(title, keys)`` of each non-empty panel, in drawing order.

    Per-task ``debug/`` keys are left out, and a panel keeps at most
    ``_MAX_KEYS_PER_PANEL`` keys, the least nested first (``rollout/reward_mean`` before
    ``rollout/stream/a/reward``), so legends stay readable on runs with many Streams.
    """

    def pick(test: Callable[[str], bool]) -> list[str]:
        chosen = [
            k
            for k in keys
            if test(k) and not k.endswith(("/min", "/max")) and not k.startswith("debug/")
        ]
        ranked = sorted(chosen, key=lambda k: (k.count("/"), chosen.index(k)))
        kept = set(ranked[:_MAX_KEYS_PER_PANEL])
        return [k for k in chosen if k in kept]

    panels = [
        ("reward", pick(lambda k: "reward" in k and "success" not in k)),
        ("loss", pick(lambda k: "loss" in k and "n_valid" not in k)),
        ("entropy", pick(lambda k: "entropy" in k)),
        ("throughput", pick(lambda k: "throughput" in k or k == TOKENS_PER_SEC)),
        ("step time (s)", pick(lambda k: k.startswith("timeperf/"))),
    ]
    return [(title, ks) for title, ks in panels if ks]


def plot_stats(path: str | Path, output: str | Path) -> Path:
    """Draw the panels of the module docstring from ``path`` into the PNG ``output``."""
    rows = load_rows(path)
    keys = _numeric_keys(rows)
    if not keys:
        raise PlotError(f"{_stats_file(Path(path))} has no numeric statistics to plot")
    add_tokens_per_sec(rows)
    keys = _numeric_keys(rows)
    panels = panel_keys(keys) or [("stats", keys[:_FALLBACK_KEYS])]

    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.8 * len(panels)), squeeze=False)
    for ax, (title, keys_in_panel) in zip(axes[:, 0], panels):
        for key in keys_in_panel:
            points = [
                (row["global_step"], row[key])
                for row in rows
                if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])
            ]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="." if len(points) < 50 else None, label=key)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    axes[-1, 0].set_xlabel("global step")
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
    args = parser.parse_args(argv)
    base = args.logdir if args.logdir.is_dir() else args.logdir.parent
    output = args.output or base / "curves.png"
    try:
        written = plot_stats(args.logdir, output)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
