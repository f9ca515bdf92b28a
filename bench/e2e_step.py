"""One trainer step end to end on the embedded default, synchronous versus asynchronous.

Runs the toy GRPO example (local scheduler, embedded ``hf`` inference server, FSDP actor
on gloo, tiny model) twice: ``rollout.max_head_offpolicyness`` 0 (synchronous: rollout
waits for every weight update) and 2 (rollouts run up to two versions ahead while the
actor trains). For each run it reports the mean time per step of each phase, as the
trainer's own timers record it (rollout wait, proximal log-probs, advantages, PPO update,
weight sync), and the throughput in trained samples per minute, measured between the
first and last step's commit times so that start-up is excluded.

    .venv/bin/python bench/e2e_step.py [--steps 10] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal.utils.table import render_table  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "e2e_step.json"
PHASES = {
    "rollout": "timeperf/rollout",
    "logp": "timeperf/recompute_logp",
    "advantages": "timeperf/compute_advantage",
    "train": "timeperf/train_step",
    "weight sync": "timeperf/update_weights",
}


def run(root: Path, eta: int, args: argparse.Namespace) -> dict:
    trial = f"eta{eta}"
    cmd = [
        sys.executable,
        "-m",
        "examples.toy.train",
        "--config",
        str(ROOT / "examples" / "toy" / "toy_grpo.yaml"),
        f"trial_name={trial}",
        f"total_train_steps={args.steps}",
        f"rollout.max_head_offpolicyness={eta}",
        f"gconfig.max_new_tokens={args.max_new_tokens}",
        f"gconfig.n_samples={args.n_samples}",
        f"train_dataset.batch_size={args.batch_size}",
        "recover.mode=off",
        "rollout.dump_to_file=false",
    ]
    env = {**os.environ, "AREAL_FILEROOT": str(root), "HF_HUB_OFFLINE": "1"}
    began = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - began
    if done.returncode != 0:
        sys.exit(f"run eta={eta} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    stats_path = root / "logs" / getpass.getuser() / "toy-grpo" / trial / "stats.jsonl"
    rows = [json.loads(line) for line in stats_path.read_text().splitlines() if line.strip()]
    steady = rows[1:]  # the first step includes the servers' warm-up
    phases = {
        name: sum(r.get(key, 0.0) for r in steady) / len(steady) for name, key in PHASES.items()
    }
    samples_per_step = args.batch_size * args.n_samples
    span = rows[-1]["time"] - rows[0]["time"]
    return {
        "max_head_offpolicyness": eta,
        "steps": len(rows),
        "phase_seconds": phases,
        "step_seconds": span / (len(rows) - 1),
        "samples_per_minute": 60.0 * samples_per_step * (len(rows) - 1) / span,
        "reward_first": rows[0]["rollout/reward_mean"],
        "reward_last": rows[-1]["rollout/reward_mean"],
        "wall_seconds_incl_startup": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3")

    with tempfile.TemporaryDirectory(prefix="areal-e2e-") as tmp:
        results = [run(Path(tmp), eta, args) for eta in (0, 2)]

    columns = ["eta", *(f"{p} s" for p in PHASES), "step s", "samples/min"]
    rows = [
        [
            r["max_head_offpolicyness"],
            *(round(r["phase_seconds"][p], 3) for p in PHASES),
            round(r["step_seconds"], 3),
            round(r["samples_per_minute"], 1),
        ]
        for r in results
    ]
    ratio = results[1]["samples_per_minute"] / results[0]["samples_per_minute"]
    title = (
        f"Trainer step on the embedded default ({args.steps} steps, "
        f"{args.batch_size} prompts x {args.n_samples} samples, "
        f"{args.max_new_tokens} new tokens; phase means exclude step 1)"
    )
    print(render_table(title, columns, rows))
    print(f"asynchronous / synchronous throughput: {ratio:.2f}x")
    report = {
        "machine": f"{os.cpu_count()} CPU cores, no GPU",
        "config": vars(args) | {"out": str(args.out)},
        "runs": results,
        "async_over_sync": ratio,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
