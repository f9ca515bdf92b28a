"""Seconds per weight update, trainer to inference server, through the real controllers.

Each case builds a ``PPOTrainer`` from the toy GRPO config (local scheduler, FSDP actor
``fsdp:d1``, one embedded ``hf`` inference server) and then repeats the handshake of the
trainer's own step (``PPOTrainer._push_weights``), timing its four phases separately:

* begin: ``rollout.begin_weight_update(v)``, the rollout side's barrier closes;
* push: ``weight_sync.push_weights``, the actor sends while the server receives (disk:
  HF save, then the server loads it; xccl: bucketed broadcasts over the weight group;
  awex: the actor copies its weights into shared ``flattened_bucket`` buffers, the
  server maps them by handle and copies them in, the actor frees them);
* set_version: ``actor.set_version(v)``;
* end: ``rollout.end_weight_update(v)``, the version reaches the rollout side.

Nothing rolls out meanwhile, so this is the cost of the sync alone (for awex, the
colocated step's ``rollout.onload()`` before the handshake is not part of it). The first
update is a warm-up (allocators, the NCCL communicator, file caches, the first handle
mappings) and is not counted.

Cases (``actor.weight_update_mode`` disk, xccl or awex; on CPU xccl runs over gloo and
awex shares torch shared memory with the ``file_system`` strategy, on GPU CUDA IPC):

``tiny-disk``, ``tiny-xccl``, ``tiny-awex``
    the toy's tiny model (``examples.toy.train.build_inputs``), float32 on CPU.
``smollm2-disk``, ``smollm2-xccl``, ``smollm2-awex``
    SmolLM2-135M-Instruct (``areal.utils.smollm2.smollm2_path``), float32 on CPU.
``qwen05b-disk``, ``qwen05b-xccl`` (GPU)
    a random Qwen2-0.5B-shaped model in bfloat16, the actor and the server each given one
    GPU (``scheduling_spec[0].gpu=1``; the local scheduler hands GPUs out round-robin, so
    with one GPU they share it). xccl needs two GPUs: NCCL refuses two ranks on one device
    (``bench/results/nccl_group_probe_1gpu_h200.json``).
``qwen05b-awex``, ``qwen4b-awex`` (GPU, one card)
    a random Qwen2-0.5B-shaped model, or a random Qwen3-4B-shaped one (hidden 2560, 36
    layers, 32 heads, 8 KV heads, head_dim 128, intermediate 9728, vocab 151936, tied
    embeddings: 4.02B parameters, 8.0 GB in bfloat16), with the rollout colocated
    (``rollout.scheduling_strategy``: colocation, target actor, fork): the ``hf:d1``
    server is forked beside the ``fsdp:d1`` actor worker and inherits its
    ``CUDA_VISIBLE_DEVICES``, so both run on the actor's one GPU (the rollout's
    ``scheduling_spec`` GPU count is not used for a forked worker). ``actor.dtype`` and
    ``sglang.dtype`` are bfloat16, as in the other GPU cases: the actor computes in and
    sends bfloat16 but, as the FSDP engine always does, keeps fp32 master weights (16 GB
    for 4B). The actor has its Adam optimizer, but nothing here trains, so its state (32 GB
    for 4B) is never allocated; on one 80 GB card the 4B case holds ~16 GB actor + 8 GB
    shared copy + 8 GB server. (A 4B actor that also trains with Adam beside its server
    would need ~16 + 16 + 32 + 8 GB on that card.) The 4B model is initialized on the GPU
    (CPU init takes minutes) and saved before the trainer starts; the benchmark process
    keeps a CUDA context on the card after that.

CPU cases hide any GPU from the workers (``CUDA_VISIBLE_DEVICES=""``), so they measure
the CPU path on a GPU machine too. Targets (medians, the whole handshake): at most 0.050 s
per update for the tiny model on CPU (disk, xccl); 2 s for the 0.5B model on one H200
over disk; awex on one GPU: 0.030 s for the 0.5B model and 0.060 s for the 4B model (the
push phase is reported beside them). GPU results name the card (``machine.gpu`` and each
GPU case's ``device_name``); ``machine.loadavg_start``/``loadavg_end`` record how busy the
machine was (the committed CPU numbers come from a 2-core machine that other work shared).

    .venv/bin/python bench/weight_sync.py [--cases tiny-disk,tiny-xccl,...] [--updates 10]
    .venv/bin/python bench/weight_sync.py \\
        --cases tiny-disk,tiny-xccl,tiny-awex,smollm2-disk,smollm2-xccl,smollm2-awex
    python3 bench/weight_sync.py --cases qwen05b-disk,qwen05b-xccl \\
        --out bench/results/weight_sync_h200.json
    python3 bench/weight_sync.py --cases qwen05b-awex,qwen4b-awex --updates 10 \\
        --out $OUT/weight_sync_awex_gpu.json

``--dry-run`` builds and checks every named case's config (``refuse_unsupported``, the
model's shape and parameter count from its HF config on the meta device) without
starting workers or writing weights: on a CPU machine it checks the GPU cases as if one
GPU were there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import secrets
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from areal.utils.table import render_table  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "weight_sync.json"
TOY_CONFIG = ROOT / "examples" / "toy" / "toy_grpo.yaml"
PHASES = ("begin", "push", "set_version", "end")
CPU_CASES = (
    "tiny-disk",
    "tiny-xccl",
    "tiny-awex",
    "smollm2-disk",
    "smollm2-xccl",
    "smollm2-awex",
)
GPU_CASES = ("qwen05b-disk", "qwen05b-xccl", "qwen05b-awex", "qwen4b-awex")
# case -> (seconds per update, the wording); checked against the median
TARGETS = {
    "tiny-disk": (0.050, "tiny model on CPU"),
    "tiny-xccl": (0.050, "tiny model on CPU"),
    "qwen05b-disk": (2.0, "0.5B model on one H200, disk"),
    "qwen05b-awex": (0.030, "0.5B model on one GPU, awex, end to end"),
    "qwen4b-awex": (0.060, "4B model on one GPU, awex, end to end"),
}
# the rollout forked beside the actor's worker, on its devices (what awex requires)
COLOCATED = [
    "rollout.scheduling_strategy.type=colocation",
    "rollout.scheduling_strategy.target=actor",
    "rollout.scheduling_strategy.fork=true",
]
# Qwen3-4B's shape (random weights), in build_tiny_model's terms
QWEN3_4B_SHAPE = dict(
    arch="qwen3",
    hidden_size=2560,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=9728,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
)


@dataclasses.dataclass
class Case:
    name: str
    model: str  # tiny | smollm2 | qwen05b | qwen4b
    mode: str  # disk | xccl | awex
    device: str  # cpu | cuda

    @classmethod
    def parse(cls, name: str) -> Case:
        model, mode = name.rsplit("-", 1)
        return cls(name, model, mode, "cuda" if name in GPU_CASES else "cpu")


def skip_reason(case: Case) -> str | None:
    if case.device != "cuda":
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if case.mode == "xccl" and torch.cuda.device_count() < 2:
        return "xccl on GPU needs 2 GPUs: NCCL refuses two ranks on one device"
    return None


def shape_of(model: str) -> dict:
    """A GPU case's model shape (:func:`areal.utils.tiny_model.build_tiny_model`'s terms)."""
    from areal.utils.tiny_model import QWEN2_05B_SHAPE

    shapes = {"qwen05b": QWEN2_05B_SHAPE, "qwen4b": QWEN3_4B_SHAPE}
    if model not in shapes:
        raise ValueError(f"no random-model shape here for model {model!r}")
    return shapes[model]


def model_dir(case: Case, tmp: Path) -> Path | None:
    """The HF directory of the case's model (``None``: the toy builds its tiny model)."""
    if case.model == "smollm2":
        from areal.utils.smollm2 import smollm2_path

        return smollm2_path()
    if case.model in ("qwen05b", "qwen4b"):
        from areal.utils.tiny_model import build_tiny_model

        # random weights in bfloat16, initialized on the GPU (a CPU init of 4B parameters
        # takes minutes); the cache is emptied so that the workers get the card
        on = "cuda" if torch.cuda.is_available() else "cpu"
        path = build_tiny_model(
            tmp / case.model, **shape_of(case.model), dtype="bfloat16", device=on
        )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return path
    return None


def overrides(case: Case, tmp: Path, model: Path | None, n_gpus: int | None = None) -> list[str]:
    """The case's config overrides; ``n_gpus`` (default: the GPUs visible here) sets
    ``cluster.n_gpus_per_node`` of a GPU case (``--dry-run`` on CPU passes 1)."""
    out = [
        f"cluster.fileroot={tmp}",
        f"trial_name={case.name}-{secrets.token_hex(3)}",
        f"actor.weight_update_mode={case.mode}",
        "recover.mode=off",
        "rollout.dump_to_file=false",
        "evaluator.freq_steps=null",
    ]
    if model is not None:
        out += [f"actor.path={model}", f"sglang.model_path={model}", "sglang.context_length=512"]
    if case.mode == "awex":
        out += COLOCATED
    if case.device == "cuda":
        out += [
            f"cluster.n_gpus_per_node={torch.cuda.device_count() if n_gpus is None else n_gpus}",
            "actor.scheduling_spec.0.gpu=1",
            # a forked (colocated) server ignores this and runs on the actor's GPU
            "rollout.scheduling_spec.0.gpu=1",
            "actor.dtype=bfloat16",
            "sglang.dtype=bfloat16",
            "rollout.setup_timeout=600",  # a 4B server loads for a while
        ]
    return out


def parameter_count(model: Path) -> int:
    """Parameters stored in ``model``'s safetensors files (tied weights counted once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names = f.keys()
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    return total


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1]


# --- one case ---


def run_case(case: Case, updates: int) -> dict:
    from areal.api.cli_args import GRPOConfig, load_expr_config
    from areal.engine.weight_sync import push_weights
    from areal.trainer.rl_trainer import PPOTrainer
    from examples.toy.train import build_inputs

    saved_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if case.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # inherited by the workers
    elif case.mode == "xccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast
    try:
        with tempfile.TemporaryDirectory(prefix="areal-ws-") as tmp:
            model = model_dir(case, Path(tmp))
            args = overrides(case, Path(tmp), model)
            cfg, _ = load_expr_config(["--config", str(TOY_CONFIG), *args], GRPOConfig)
            dataset, _, _ = build_inputs(cfg)  # builds the tiny model when it is the one
            params = parameter_count(Path(cfg.actor.path))
            itemsize = getattr(torch, cfg.actor.dtype).itemsize  # the dtype sent
            began = time.perf_counter()
            with PPOTrainer(cfg, dataset, None) as trainer:
                setup_s = time.perf_counter() - began
                seconds = {p: [] for p in (*PHASES, "total")}
                push_parts: dict[str, list[float]] = {}
                for version in range(1, updates + 2):  # version 1 is the warm-up
                    stamps = [time.perf_counter()]
                    trainer.rollout.begin_weight_update(version)
                    stamps.append(time.perf_counter())
                    parts: dict[str, float] = {}  # awex: share, load, release
                    push_weights(
                        trainer.actor,
                        trainer.rollout,
                        trainer._meta_for(version),
                        trainer.actor.weight_plan,
                        parts,
                    )
                    for name, value in parts.items():
                        push_parts.setdefault(name, []).append(value)
                    stamps.append(time.perf_counter())
                    trainer.actor.set_version(version)
                    stamps.append(time.perf_counter())
                    trainer.rollout.end_weight_update(version)
                    stamps.append(time.perf_counter())
                    for phase, start, stop in zip(PHASES, stamps, stamps[1:]):
                        seconds[phase].append(stop - start)
                    seconds["total"].append(stamps[-1] - stamps[0])
    finally:
        if saved_visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved_visible
    timed = seconds["total"][1:]
    return {
        **dataclasses.asdict(case),
        "device_name": torch.cuda.get_device_name(0) if case.device == "cuda" else None,
        "params": params,
        "bytes": params * itemsize,
        "dtype": cfg.actor.dtype,
        "overrides": args,
        "setup_s": setup_s,
        "warmup_s": seconds["total"][0],
        "median_s": statistics.median(timed),
        "p90_s": p90(timed),
        "max_s": max(timed),
        "phase_median_s": {p: statistics.median(seconds[p][1:]) for p in PHASES},
        # awex: the push's parts (the ranks share, the servers load, the ranks free)
        "push_part_median_s": {k: statistics.median(v[1:]) for k, v in push_parts.items()},
        "update_s": timed,
    }


# --- checking the configs without running them ---


def dry_run(cases: list[Case]) -> bool:
    """Build and check each case's config (as :class:`PPOTrainer` does before any worker
    starts) and the shape of its model; print what each would run. True if all pass."""
    from transformers import AutoModelForCausalLM

    from areal.api.cli_args import GRPOConfig, load_expr_config
    from areal.api.config.support import unsupported

    rows, ok = [], True
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="areal-ws-dry-") as tmp:
            params = None
            if case.model in ("qwen05b", "qwen4b"):  # the config only, no weights
                from areal.utils.tiny_model import tiny_model_config

                config, _ = tiny_model_config(**shape_of(case.model))
                model = Path(tmp) / case.model
                config.save_pretrained(model)
                with torch.device("meta"):
                    params = sum(
                        p.numel() for p in AutoModelForCausalLM.from_config(config).parameters()
                    )  # tied embeddings counted once
            else:
                model = model_dir(case, Path(tmp))
                if model is not None:
                    params = parameter_count(model)
            gpus = 1 if case.device == "cuda" and not torch.cuda.is_available() else None
            args = overrides(case, Path(tmp), model, n_gpus=gpus)
            cfg, _ = load_expr_config(["--config", str(TOY_CONFIG), *args], GRPOConfig)
            problems = [str(e) for e in unsupported(cfg)]
        strategy = cfg.rollout.scheduling_strategy
        colocated = strategy is not None and strategy.type == "colocation"
        itemsize = getattr(torch, cfg.actor.dtype).itemsize
        # awex on one card: the actor's fp32 master weights, the shared copy, the server's
        on_card = params and case.device == "cuda" and case.mode == "awex"
        gb = params * (4 + itemsize + itemsize) / 1e9 if on_card else None
        ok &= not problems
        rows.append(
            [
                case.name,
                params,
                f"{params * itemsize / 1e6:.1f}" if params else None,
                case.device,
                cfg.actor.weight_update_mode,
                f"{cfg.actor.backend} / {cfg.rollout.backend}",
                (
                    f"{strategy.type}:{strategy.target}{',fork' if strategy.fork else ''}"
                    if colocated
                    else "separate"
                ),
                f"{cfg.actor.scheduling_spec[0].gpu}/{cfg.rollout.scheduling_spec[0].gpu}",
                f"{cfg.actor.dtype}/{cfg.sglang.dtype}",
                f"{gb:.1f}" if gb else None,
                "; ".join(problems) or "ok",
            ]
        )
        print(f"{case.name}: {' '.join(args)}")
    columns = [
        "case",
        "params",
        "MB sent",
        "device",
        "mode",
        "actor / rollout",
        "rollout placement",
        "GPUs a/r",
        "dtype a/s",
        "awex GB on card",
        "config check",
    ]
    print("\n" + render_table("Dry run: the cases' configs", columns, rows))
    return ok


# --- report ---


def table(results: list[dict], updates: int, gpu: str | None = None) -> str:
    columns = ["case", "params", "MB", "median s", "p90 s", "max s", *(f"{p} s" for p in PHASES)]
    rows = []
    for r in results:
        if "median_s" not in r:
            status = "skipped" if "skipped" in r else "failed"
            rows.append([r["name"], None, None, status, *[None] * (len(columns) - 4)])
            continue
        rows.append(
            [
                r["name"],
                r["params"],
                r["bytes"] / 1e6,
                *(f"{r[k]:.3f}" for k in ("median_s", "p90_s", "max_s")),
                *(f"{r['phase_median_s'][p]:.3f}" for p in PHASES),
            ]
        )
    title = f"Weight update, trainer to inference server ({updates} timed updates after a warm-up)"
    if gpu and any(r["device"] == "cuda" and "median_s" in r for r in results):
        title += f"; GPU cases on {gpu}"
    return render_table(title, columns, rows)


def check_targets(results: list[dict]) -> dict:
    verdicts = {}
    for r in results:
        if r["name"] not in TARGETS or "median_s" not in r:
            continue
        limit, what = TARGETS[r["name"]]
        met = r["median_s"] <= limit
        verdicts[r["name"]] = {
            "target_s": limit,
            "what": what,
            "median_s": r["median_s"],
            "push_median_s": r["phase_median_s"]["push"],
            "met": met,
        }
        print(
            f"target {r['name']} ({what}): median {r['median_s']:.3f} s <= {limit:.3f} s: "
            f"{'met' if met else 'not met'}"
            + (f" (push {r['phase_median_s']['push']:.3f} s)" if r["mode"] == "awex" else "")
        )
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cases",
        default=",".join(CPU_CASES),
        help=f"comma-separated, of {', '.join(CPU_CASES + GPU_CASES)} (default: the CPU cases)",
    )
    parser.add_argument("--updates", type=int, default=10, help="timed updates per case")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help=f"the JSON report (default: {RESULTS})"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="build and check the cases' configs only (no workers, no weights, no JSON)",
    )
    args = parser.parse_args()
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(names) - set(CPU_CASES + GPU_CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}")
    if args.updates < 2:
        parser.error("--updates must be at least 2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.dry_run:
        sys.exit(0 if dry_run([Case.parse(n) for n in names]) else 1)

    load_start = os.getloadavg()  # other work on the machine skews CPU numbers
    results = []
    for case in map(Case.parse, names):
        reason = skip_reason(case)
        if reason is not None:
            print(f"{case.name}: skipped ({reason})")
            results.append({**dataclasses.asdict(case), "skipped": reason})
            continue
        try:
            results.append(run_case(case, args.updates))
        except Exception as e:  # one broken case should not lose the others' numbers
            traceback.print_exc()
            results.append({**dataclasses.asdict(case), "error": f"{type(e).__name__}: {e}"})

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    print("\n" + table(results, args.updates, gpu))
    for r in results:
        if "error" in r:
            print(f"{r['name']} failed: {r['error'][:300]}")
    targets = check_targets(results)
    report = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "gpu": gpu,
            "gpu_count": torch.cuda.device_count() if gpu else 0,
            "torch": torch.__version__,
            # 1/5/15-minute load averages when the cases began and when they ended
            "loadavg_start": [round(x, 2) for x in load_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        },
        "config": {
            "cases": names,
            "updates": args.updates,
            "base_config": str(TOY_CONFIG.relative_to(ROOT)),
        },
        "targets": targets,
        "cases": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
