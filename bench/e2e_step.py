"""Trainer steps end to end on the embedded default, synchronous versus asynchronous.

Two workloads, each trained with ``rollout.max_head_offpolicyness`` 0 (synchronous:
rollouts wait for every weight update) and then asynchronously (rollouts run up to that
many versions ahead while the actor trains):

``toy``
    the toy GRPO example (local scheduler, embedded ``hf`` inference server, FSDP actor on
    gloo, tiny model); rollout and training share the two cores, η = 0 and 2.
``agent``
    Arena GRPO on the local Arena (``examples.swe.train_swe_rl`` on ``arena_local.yaml``,
    tiny model): the Stream ``arith-turns``, whose Harness makes ``--turns`` LLM calls per
    task through the rollout proxy and the ``--route-mode`` route, each followed by
    ``--env-ms`` of environment time (the local Arena's ``env_latency_ms`` latency
    injection): rollouts dominated by environment time, as real agent tasks are. η = 0, 1
    and 2.

For each run: the mean time per step of each phase, as the trainer's own timers record it
(rollout wait, proximal log-probs, advantages, PPO update, weight sync), the step time
and the throughput in trained samples per minute, measured between the commit times of
the first and the last step so that start-up and the first step (the servers' warm-up,
and for asynchronous runs the pipeline filling) are excluded.

The agent workload also reports the overlap efficiency of each asynchronous run: its step
time over max(rollout-only, train-plus-sync-only), both measured in the synchronous run of
the same invocation (its rollout phase, when nothing trains, and the rest of its step,
when nothing rolls out). 1.0 is perfect overlap of one batch's rollout with the previous
batch's training; below 1.0 the asynchronous run also gains from having more tasks in
flight.

    .venv/bin/python bench/e2e_step.py [--workload toy|agent|all] [--steps 10]
        [--env-ms 500] [--turns 3] [--route-mode session_gateway]
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal.utils.table import render_table  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CATALOG = ROOT / "examples" / "swe" / "local_arena" / "catalogs" / "default.yaml"
PHASES = {
    "rollout": "timeperf/rollout",
    "logp": "timeperf/recompute_logp",
    "advantages": "timeperf/compute_advantage",
    "train": "timeperf/train_step",
    "weight sync": "timeperf/update_weights",
}
AGENT_STREAM = "arith-turns"
AGENT_HARNESS = "chat-turns"
ARITHMETIC_ROWS = 40  # rows of the Stream's dataset: one mixture epoch at most


def _run(cmd: list[str], env: dict[str, str], what: str) -> float:
    began = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{what} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.monotonic() - began


def summarize(stats_path: Path, eta: int, samples_per_step: int, wall: float) -> dict:
    rows = [json.loads(line) for line in stats_path.read_text().splitlines() if line.strip()]
    if len(rows) < 3:
        sys.exit(f"{stats_path}: {len(rows)} steps logged; at least 3 are needed")
    steady = rows[1:]  # the first step includes the servers' warm-up (and the pipeline fill)
    phases = {
        name: sum(r.get(key, 0.0) for r in steady) / len(steady) for name, key in PHASES.items()
    }
    span = steady[-1]["time"] - rows[0]["time"]
    step_seconds = span / len(steady)
    return {
        "max_head_offpolicyness": eta,
        "steps": len(rows),
        "phase_seconds": phases,
        "step_seconds": step_seconds,
        # what the trainer does besides waiting for the batch (the step's own timer)
        "train_plus_sync_seconds": step_seconds - phases["rollout"],
        "samples_per_minute": 60.0 * samples_per_step / step_seconds,
        "reward_first": rows[0]["rollout/reward_mean"],
        "reward_last": rows[-1]["rollout/reward_mean"],
        "wall_seconds_incl_startup": wall,
    }


# --- the toy workload ---


def run_toy(root: Path, eta: int, args: argparse.Namespace) -> dict:
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
        "evaluator.freq_steps=null",  # no held-out evaluation inside the measured steps
    ]
    env = {**os.environ, "AREAL_FILEROOT": str(root), "HF_HUB_OFFLINE": "1"}
    wall = _run(cmd, env, f"toy run eta={eta}")
    stats = root / "logs" / getpass.getuser() / "toy-grpo" / trial / "stats.jsonl"
    return summarize(stats, eta, args.batch_size * args.n_samples, wall)


# --- the agent workload ---


def agent_catalog(out: Path, env_ms: float, turns: int) -> Path:
    """The default catalog with its datasets at absolute paths, the multi-turn Harness at
    ``turns`` turns and ``env_ms`` of environment time after each LLM call."""
    catalog = yaml.safe_load(CATALOG.read_text())
    for entry in catalog["datasets"].values():
        if "file" in entry:
            entry["file"] = str((CATALOG.parent / entry["file"]).resolve())
    for harness in catalog["harnesses"]:
        if harness["key"] == AGENT_HARNESS:
            harness["options"] = {**harness.get("options", {}), "turns": turns}
    catalog["faults"] = {"env_latency_ms": env_ms}
    out.write_text(yaml.safe_dump(catalog, sort_keys=False))
    return out


def run_agent(root: Path, model: Path, catalog: Path, eta: int, args: argparse.Namespace) -> dict:
    trial = f"agent-eta{eta}"
    batch, samples = args.batch_size, args.n_samples
    epoch = (ARITHMETIC_ROWS // batch) * batch
    cmd = [
        sys.executable,
        "-m",
        "examples.swe.train_swe_rl",
        "--config",
        str(ROOT / "examples" / "swe" / "arena_local.yaml"),
        f"trial_name={trial}",
        f"total_train_steps={args.steps}",
        "total_train_epochs=100",
        f"train_dataset.batch_size={batch}",
        f"gconfig.n_samples={samples}",
        f"gconfig.max_new_tokens={args.max_new_tokens}",
        f"rollout.max_head_offpolicyness={eta}",
        # room for every task the staleness bound admits: (eta + 1) batches in flight
        f"rollout.max_concurrent_rollouts={(eta + 1) * batch * samples}",
        "rollout.dump_to_file=false",
        f"econfig.arena_mixture_epoch_size={epoch}",
        f"econfig.arena_streams=[{{name: turns, stream_id: {AGENT_STREAM}}}]",
    ]
    if args.poll_interval is not None:
        cmd.append(f"econfig.arena_poll_interval={args.poll_interval}")
    env = {
        **os.environ,
        "AREAL_FILEROOT": str(root),
        "MODEL_PATH": str(model),
        "SWE_RL_ADMIN_API_KEY": secrets.token_urlsafe(24),
        "AREAL_LOCAL_ARENA_CATALOG": str(catalog),
        "ARENA_ROUTE_MODE": args.route_mode,
        "HF_HUB_OFFLINE": "1",
    }
    for name in ("ARENA_OPENAPI_BASE", "ARENA_OPENAPI_TOKEN", "ARENA_LLM_API_KEY"):
        env.pop(name, None)
    wall = _run(cmd, env, f"agent run eta={eta}")
    stats = root / "logs" / getpass.getuser() / "arena-local" / trial / "stats.jsonl"
    return summarize(stats, eta, batch * samples, wall)


def overlap(results: list[dict]) -> None:
    """Each asynchronous run's overlap efficiency against the synchronous run's phases."""
    sync = results[0]
    bound = max(sync["phase_seconds"]["rollout"], sync["train_plus_sync_seconds"])
    for r in results[1:]:
        r["overlap_efficiency"] = r["step_seconds"] / bound
        r["over_sync"] = r["samples_per_minute"] / sync["samples_per_minute"]


# --- report ---


def table(title: str, results: list[dict]) -> str:
    columns = ["eta", *(f"{p} s" for p in PHASES), "step s", "samples/min", "x sync", "overlap"]
    rows = [
        [
            r["max_head_offpolicyness"],
            *(round(r["phase_seconds"][p], 3) for p in PHASES),
            round(r["step_seconds"], 3),
            round(r["samples_per_minute"], 1),
            round(r.get("over_sync", 1.0), 2),
            round(r["overlap_efficiency"], 2) if "overlap_efficiency" in r else "-",
        ]
        for r in results
    ]
    return render_table(title, columns, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["toy", "agent", "all"], default="all")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--env-ms", type=float, default=500.0, help="agent: per turn")
    parser.add_argument("--turns", type=int, default=3, help="agent: LLM calls per task")
    parser.add_argument(
        "--route-mode", choices=["gateway", "session_gateway", "direct"], default="session_gateway"
    )
    parser.add_argument(
        "--poll-interval", type=float, default=None, help="agent: Arena polls (profile's)"
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3")
    machine = f"{os.cpu_count()} CPU cores, no GPU"
    args.out_dir.mkdir(parents=True, exist_ok=True)

    if args.workload in ("toy", "all"):
        toy = argparse.Namespace(**{**vars(args), "max_new_tokens": args.max_new_tokens or 32})
        with tempfile.TemporaryDirectory(prefix="areal-e2e-") as tmp:
            results = [run_toy(Path(tmp), eta, toy) for eta in (0, 2)]
        overlap(results)
        title = (
            f"Toy GRPO step on the embedded default ({args.steps} steps, {args.batch_size} "
            f"prompts x {args.n_samples} samples, {toy.max_new_tokens} new tokens; "
            "means exclude step 1)"
        )
        print(table(title, results))
        ratio = results[1]["over_sync"]
        print(f"asynchronous / synchronous throughput: {ratio:.2f}x")
        report = {"machine": machine, "config": vars(toy) | {"out_dir": str(args.out_dir)}}
        out = args.out_dir / "e2e_step.json"
        out.write_text(
            json.dumps({**report, "runs": results, "async_over_sync": ratio}, indent=2) + "\n"
        )
        print(f"wrote {out}")

    if args.workload in ("agent", "all"):
        from areal.utils.tiny_model import build_tiny_model

        agent = argparse.Namespace(**{**vars(args), "max_new_tokens": args.max_new_tokens or 16})
        with tempfile.TemporaryDirectory(prefix="areal-e2e-agent-") as tmp:
            model = build_tiny_model(Path(tmp) / "tiny", seed=0)
            catalog = agent_catalog(Path(tmp) / "catalog.yaml", args.env_ms, args.turns)
            results = [run_agent(Path(tmp), model, catalog, eta, agent) for eta in (0, 1, 2)]
        overlap(results)
        title = (
            f"Arena agent workload, local Arena ({args.steps} steps, {args.batch_size} prompts "
            f"x {args.n_samples} samples, {args.turns} turns x ({agent.max_new_tokens} tokens "
            f"+ {args.env_ms:g} ms environment), route {args.route_mode}; means exclude step 1)"
        )
        print(table(title, results))
        best = max(r["over_sync"] for r in results[1:])
        worst_overlap = max(r["overlap_efficiency"] for r in results[1:])
        print(
            f"targets: async >= 2x sync: {best:.2f}x ({'met' if best >= 2 else 'not met'}); "
            f"overlap efficiency <= 1.15: {worst_overlap:.2f} "
            f"({'met' if worst_overlap <= 1.15 else 'not met'})"
        )
        out = args.out_dir / "e2e_step_agent.json"
        report = {
            "machine": machine,
            "config": vars(agent) | {"out_dir": str(args.out_dir)},
            "runs": results,
            "async_over_sync_best": best,
            "overlap_efficiency_worst": worst_overlap,
        }
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
