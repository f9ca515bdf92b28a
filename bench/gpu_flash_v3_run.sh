#!/usr/bin/env bash
# Flash V3 GPU items on one GPU, in one time-budgeted run:
#   1. issue 33 parity: tests/gpu/test_bailing_gpu.py (FSDP packed path with fla, KDA kernels,
#      HF model; then the Megatron bridge with fla against the torch KDA and HF);
#   2. issue 33 throughput: bench/train_engine.py --shape ling3-1b, FSDP then Megatron;
#   3. issue 34: the longest sequence a Qwen2-0.5B-shaped model trains at c1 (FSDP engine, one
#      sequence a step, log-probs in chunks, activation checkpointing): 32K, 64K, 128K, ...
#      each length its own process, up to the first OOM or the time cap;
#   4. a compact summary on stdout and in $OUT/summary.json.
#
# Run from the repository root, with torch, transformers, flash-linear-attention,
# megatron-core and mbridge importable (PYTHONPATH) and $OUT an output directory:
#   OUT=/tmp/out bash bench/gpu_flash_v3_run.sh
# (with the device tool: OUT=/tmp/fv3 FLASH_V3_PACK_TO=$OUT bash bench/gpu_flash_v3_run.sh, since
# only 8 files come back)
#
# FLASH_V3_STEPS (default parity,ling3,long_seq) picks the parts to run; a part left out
# passes its time on. FLASH_V3_FLA_AUTOTUNE (default quick) sets AREAL_FLA_AUTOTUNE for every
# process (areal/engine/kda.py: fla's kernels keep two tuning candidates each; `full` for
# fla's whole autotuning, minutes of compilation per process). FLASH_V3_TRITON_SEED names a
# .tar.gz of an earlier run's Triton cache to start from; with FLASH_V3_PACK_TO the cache is
# packed beside the outputs (triton_cache.tar.gz) when it is small enough to come back.
#
# Every step runs under its own `timeout` and writes its whole output to $OUT/logs/<step>.log;
# a failing or timed-out step does not stop the next. Time: FLASH_V3_BUDGET_S (default 500 s)
# for the whole run. Steps end at cumulative deadlines, so time a step leaves unused passes to
# the next: parity FLASH_V3_PARITY_S (150), then FLASH_V3_LING3_FSDP_S (140) and
# FLASH_V3_LING3_MEGATRON_S (100), then the long-sequence search until the budget's end less
# FLASH_V3_SUMMARY_S (15) for the summary.
#
# The parity tests are correctness checks on tiny models, so their two pytest processes (FSDP,
# KDA and HF tests; the Megatron bridge test) run side by side on the GPU, each compiling its
# own Triton kernels on the CPU cores, and beside them a CPU-only process writes the random
# ling3-1b and Qwen2-0.5B checkpoints the benches load. The benches run alone. The tests do not
# store autotuning choices (FLA_CACHE_RESULTS=0: timings taken beside another process); the
# compiled kernels stay in the shared Triton cache, and each bench autotunes on its own.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
OUT=${OUT:-$REPO/gpu_flash_v3_out}
BUDGET=${FLASH_V3_BUDGET_S:-500}
PARITY=${FLASH_V3_PARITY_S:-150}
LING3_FSDP=${FLASH_V3_LING3_FSDP_S:-140}
LING3_MEGATRON=${FLASH_V3_LING3_MEGATRON_S:-100}
SUMMARY_RESERVE=${FLASH_V3_SUMMARY_S:-15}
MIN_STEP=${FLASH_V3_MIN_STEP_S:-20}      # a step with less time left is skipped
SCRATCH=${FLASH_V3_SCRATCH:-/tmp/flash_v3}
LOGS=$OUT/logs
mkdir -p "$OUT" "$LOGS" "$OUT/parity" "$OUT/long_seq" "$SCRATCH" || exit 1
STEPS_TSV=$OUT/steps.tsv
printf 'step\trc\twall_s\tlimit_s\n' >"$STEPS_TSV"

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export TOKENIZERS_PARALLELISM=false
# one Triton cache for every process: kernels the tests compile and autotune (fla's KDA at
# 16 heads of 64) are those the ling3-1b bench needs
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$SCRATCH/triton-cache}
PY=${PYTHON:-python3}
STEPS=${FLASH_V3_STEPS:-parity,ling3,long_seq}
export AREAL_FLA_AUTOTUNE=${FLASH_V3_FLA_AUTOTUNE:-quick}
want() { [[ ",$STEPS," == *",$1,"* ]]; }
mkdir -p "$TRITON_CACHE_DIR"
if [[ -n ${FLASH_V3_TRITON_SEED:-} ]]; then
    tar xzf "$FLASH_V3_TRITON_SEED" -C "$TRITON_CACHE_DIR" &&
        echo "Triton cache seeded from $FLASH_V3_TRITON_SEED: $(du -sh "$TRITON_CACHE_DIR" | cut -f1)"
fi

T0=$SECONDS
elapsed() { echo $((SECONDS - T0)); }
# seconds until the deadline $1 (counted from the start), never below 0
until_deadline() {
    local deadline=$1 cap=$((BUDGET - SUMMARY_RESERVE))
    ((deadline > cap)) && deadline=$cap
    local left=$((deadline - (SECONDS - T0)))
    ((left < 0)) && left=0
    echo "$left"
}

gpu_memory() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | head -n 2
    fi
}

# run_step NAME LIMIT_S COMMAND...: the command under `timeout` (its whole process group
# ends at the limit), all output to $LOGS/NAME.log; the outcome goes to steps.tsv.
run_step() {
    local name=$1 limit=$2
    shift 2
    local log=$LOGS/$name.log
    if ((limit < MIN_STEP)); then
        echo "[$(elapsed) s] $name: skipped, ${limit} s left in its share" | tee "$log"
        printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >>"$STEPS_TSV"
        return 0
    fi
    echo "[$(elapsed) s] $name: starting, limit ${limit} s, log $log"
    local began=$SECONDS rc
    {
        echo "# $name, limit ${limit} s, started at $(date -u +%FT%TZ): $*"
        echo "# GPU before: $(gpu_memory)"
    } >"$log"
    # SIGUSR1 at the limit: the benches print every thread's stack on it (faulthandler), so a
    # step that hangs says where; whatever is left 15 s later is killed
    timeout --signal=USR1 --kill-after=15 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    local wall=$((SECONDS - began))
    echo "# exit status $rc after ${wall} s; GPU after: $(gpu_memory)" >>"$log"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$wall" "$limit" >>"$STEPS_TSV"
    local verdict="exit status $rc"
    ((rc == 124 || rc == 137)) && verdict="TIMED OUT (exit status $rc)"
    echo "[$(elapsed) s] $name: $verdict after ${wall} s"
    tail -n 4 "$log" | sed 's/^/    | /'
    return 0
}

echo "Flash V3 GPU run: budget ${BUDGET} s, parts $STEPS, AREAL_FLA_AUTOTUNE=$AREAL_FLA_AUTOTUNE, output $OUT"

# --- 0. environment (versions, card) ---
run_step env 60 "$PY" - <<'PY'
import importlib, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("card", torch.cuda.get_device_name(), f"{p.total_memory / 2**30:.1f} GiB", "count",
          torch.cuda.device_count())
for name in ("triton", "transformers", "fla", "megatron.core", "mbridge", "flash_attn"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as e:  # noqa: BLE001
        print(name, "NOT importable:", type(e).__name__, e)
PY

# --- 1. issue 33 parity: tests/gpu/test_bailing_gpu.py ---
# A pytest plugin records each test's outcome as it ends (the JUnit report is written only
# when pytest finishes, which a timeout prevents).
PLUGIN_DIR=$SCRATCH/pytest-plugin
mkdir -p "$PLUGIN_DIR"
cat >"$PLUGIN_DIR/flash_v3_outcomes.py" <<'PY'
import json, os, time

_PATH = os.environ["FLASH_V3_OUTCOMES"]


def _write(record):
    with open(_PATH, "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _write({"test": nodeid.split("::", 1)[-1], "event": "start", "time": time.time()})


def pytest_runtest_logreport(report):
    if report.when != "call" and report.passed:
        return
    record = {"test": report.nodeid.split("::", 1)[-1], "event": report.when,
              "outcome": report.outcome, "seconds": round(report.duration, 2)}
    if report.failed or report.skipped:
        record["detail"] = str(report.longrepr)[-6000:]
    _write(record)
PY
TEST=tests/gpu/test_bailing_gpu.py
PARITY_ENV=(env CI=true FLA_CACHE_RESULTS=0 "PYTHONPATH=$PLUGIN_DIR:$PYTHONPATH"
    "FLASH_V3_OUTCOMES=$OUT/parity/outcomes.jsonl"
    "BAILING_GPU_RESULTS=$OUT/parity/figures.jsonl" "BAILING_GPU_LOG_DIR=$OUT/parity")
PYTEST=("$PY" -m pytest -p no:cacheprovider -p flash_v3_outcomes -v -s -rA --tb=long
    --durations=0 -W "ignore::DeprecationWarning")
LING3_MODEL=$SCRATCH/ling3-1b-model
QWEN_MODEL=$SCRATCH/qwen2-0.5b-model
LONGEST=1048576  # the search's last length, and the Qwen2 checkpoint's position limit
PIDS=()
if want parity; then
    DEADLINE=$PARITY
    LIMIT=$(until_deadline "$DEADLINE")
    # FSDP packed path first (the open item), then what shares its compiled kernels, then the
    # HF model (transformers' non-varlen call with a bfloat16 decay compiles kernels of its own)
    run_step parity_fsdp_kda_hf "$LIMIT" "${PARITY_ENV[@]}" "${PYTEST[@]}" \
        --basetemp="$SCRATCH/pytest-fsdp" --junitxml="$OUT/parity/junit_fsdp_kda_hf.xml" \
        "$TEST::test_fsdp_engine_packed_logprobs_match_one_sequence_at_a_time" \
        "$TEST::test_packed_kda_forward_fla_matches_torch_path" \
        "$TEST::test_chunked_kda_matches_fla_chunk_kda" \
        "$TEST::test_hf_model_logprobs_with_fla_match_torch_fallback" &
    PIDS+=($!)
    # two workers in turn (fla, then torch KDA): the first may take 60 % of the step
    WORKER_LIMIT=$((LIMIT * 60 / 100))
    ((WORKER_LIMIT < 60)) && WORKER_LIMIT=60
    run_step parity_megatron "$LIMIT" "${PARITY_ENV[@]}" \
        "BAILING_GPU_WORKER_TIMEOUT=$WORKER_LIMIT" "${PYTEST[@]}" \
        --basetemp="$SCRATCH/pytest-megatron" --junitxml="$OUT/parity/junit_megatron.xml" \
        "$TEST::test_megatron_bridge_with_fla_matches_torch_kda_and_hf" &
    PIDS+=($!)
else
    LIMIT=${FLASH_V3_BUILD_S:-150}
fi
# CPU only: the benches' random checkpoints (a bench builds its own if this is cut short)
# shellcheck disable=SC2317  # run through `bash -c` (timeout runs commands, not functions)
build_checkpoints() {
    if want ling3; then
        "$PY" bench/train_engine.py --build-only --shape ling3-1b --model-dir "$LING3_MODEL" ||
            return
    fi
    if want long_seq; then
        "$PY" bench/train_engine.py --build-only --shape qwen2-0.5b --model-dir "$QWEN_MODEL" \
            --max-position-embeddings "$LONGEST"
    fi
}
export -f build_checkpoints want
export PY STEPS LING3_MODEL QWEN_MODEL LONGEST
if want ling3 || want long_seq; then
    run_step build_checkpoints "$LIMIT" bash -c build_checkpoints &
    PIDS+=($!)
fi
((${#PIDS[@]})) && wait "${PIDS[@]}"
want parity || DEADLINE=$((SECONDS - T0))

# --- 2. issue 33 throughput: ~1.2B Ling 3, FSDP then Megatron ---
if want ling3; then
    LING3_ARGS=(bench/train_engine.py --shape ling3-1b --steps 2 --warmup 1 --sequences 8
        --max-len 4096 --model-dir "$LING3_MODEL")
    DEADLINE=$((DEADLINE + LING3_FSDP))
    run_step ling3_fsdp "$(until_deadline "$DEADLINE")" "$PY" "${LING3_ARGS[@]}" \
        --engines fsdp --out "$OUT/train_engine_ling3-1b_fsdp.json"
    DEADLINE=$((DEADLINE + LING3_MEGATRON))
    run_step ling3_megatron "$(until_deadline "$DEADLINE")" "$PY" "${LING3_ARGS[@]}" \
        --engines megatron --out "$OUT/train_engine_ling3-1b_megatron.json"
fi

# --- 3. issue 34: the longest Qwen2-0.5B sequence at c1 ---
# A driver starts one bench process per length (an OOM cannot poison the next) and stops at
# the first failure, at the first OOM, or when the next length would not finish in time
# (predicted from the last run: fixed start-up cost plus steps scaled by the FLOP count).
if want long_seq; then
DEADLINE=$((BUDGET - SUMMARY_RESERVE))
LIMIT=$(until_deadline "$DEADLINE")
run_step long_seq "$LIMIT" env "FLASH_V3_LONG_DEADLINE_S=$((LIMIT - 5))" \
    "FLASH_V3_OUT=$OUT" "FLASH_V3_QWEN_MODEL=$QWEN_MODEL" "FLASH_V3_LONGEST=$LONGEST" \
    "FLASH_V3_PY=$PY" \
    "PYTORCH_CUDA_ALLOC_CONF=${FLASH_V3_ALLOC_CONF:-expandable_segments:True}" \
    "$PY" - <<'PY'
import json, os, subprocess, time
from pathlib import Path

began = time.time()
deadline = began + float(os.environ["FLASH_V3_LONG_DEADLINE_S"])
out = Path(os.environ["FLASH_V3_OUT"]) / "long_seq"
model = os.environ["FLASH_V3_QWEN_MODEL"]
python = os.environ["FLASH_V3_PY"]
longest = int(os.environ["FLASH_V3_LONGEST"])
first = int(os.environ.get("FLASH_V3_FIRST_LENGTH", "32768"))
lengths = [first << i for i in range(longest.bit_length()) if first << i <= longest]
# Qwen2-0.5B: 24 layers, hidden 896, intermediate 4864, 151936-token tied vocabulary
params = 24 * (2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864) + 151936 * 896


def flops(length: int) -> float:  # the bench's count: matmuls + causal attention
    return 6.0 * params * length + 6 * 24 * 896 * length * length


summary = {"card": None, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
           "runs": [], "longest_trained": None, "stopped": None}
overhead, last, growth = 60.0, None, 1.0  # start-up cost (s); the last success; step growth


def save() -> None:  # after every run, so a cut search keeps what it measured
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


for length in lengths:
    left = deadline - time.time()
    warmup = 1
    if last is not None:
        # step time scales with the FLOP count, or as fast as it last grew if faster
        step = last["step_s"] * max(flops(length) / flops(last["length"]), growth)
        cost = {w: 1.2 * (overhead + (w + 1) * step) for w in (0, 1)}  # predicted wall
        if cost[1] > left:
            warmup = 0  # the timed step then includes first-step costs: flagged below
        if cost[warmup] > left:
            summary["stopped"] = (f"time cap before {length}: predicted "
                                  f"{cost[warmup]:.0f} s, {left:.0f} s left")
            break
    if left < 20:
        summary["stopped"] = f"time cap before {length}: {left:.0f} s left"
        break
    result = out / f"qwen2-0.5b_{length}.json"
    log = out / f"qwen2-0.5b_{length}.log"
    argv = [python, "bench/train_engine.py", "--shape", "qwen2-0.5b", "--only", "engine",
            "--gradient-checkpointing", "--logprobs-chunk-size", "8192", "--sequences", "1",
            "--min-len", str(length), "--max-len", str(length), "--engine-mb-tokens",
            str(length), "--steps", "1", "--warmup", str(warmup), "--model-dir", model,
            "--max-position-embeddings", str(longest), "--out", str(result)]
    print(f"[{time.time() - began:6.1f} s] {length} tokens, warm-up {warmup}, "
          f"{left:.0f} s left: {' '.join(argv)}", flush=True)
    start = time.time()
    with open(log, "w") as f:
        # same process group: the step's `timeout` ends it too
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "timeout"
    wall = time.time() - start
    run = {"length": length, "warmup_steps": warmup, "rc": rc, "wall_s": round(wall, 1),
           "log": str(log)}
    text = log.read_text(errors="replace")
    engine = {}
    if result.exists():
        data = json.loads(result.read_text())
        summary["card"] = data.get("device")
        engine = data.get("results", {}).get("engine", {})
    if "step_s" in engine:
        run.update(outcome="trained", step_s=engine["step_s"],
                   tokens_per_s=engine["tokens_per_s"], mfu=engine["mfu"],
                   peak_mem_gb=engine["peak_mem_gb"],
                   peak_reserved_gb=engine.get("peak_reserved_gb"),
                   warmup_step_s=engine.get("warmup_step_s"))
        summary["runs"].append(run)
        summary["longest_trained"] = length
        save()
        overhead = max(wall - sum(engine.get("warmup_step_s") or []) - engine["step_s"], 5.0)
        if last is not None:
            growth = engine["step_s"] / last["step_s"]
        last = {"length": length, "step_s": engine["step_s"]}
        print(f"    trained: {engine['step_s']:.2f} s/step, {engine['tokens_per_s']:.0f} "
              f"tokens/s, MFU {100 * engine['mfu']:.1f} %, peak "
              f"{engine['peak_mem_gb']:.1f} GiB ({wall:.0f} s in all)", flush=True)
        continue
    oom = engine.get("oom") or "out of memory" in text.lower()
    run["outcome"] = "oom" if oom else ("timeout" if rc == "timeout" else "failed")
    run["error"] = engine.get("error") or "\n".join(text.splitlines()[-25:])
    summary["runs"].append(run)
    summary["stopped"] = f"{run['outcome']} at {length}"
    print(f"    {run['outcome']} at {length} after {wall:.0f} s; last lines:\n"
          + "\n".join(text.splitlines()[-12:]), flush=True)
    break
else:
    summary["stopped"] = f"every length up to {longest} tokens trained"
save()
print(f"longest trained: {summary['longest_trained']}; stopped: {summary['stopped']}")
PY
fi

# --- 4. summary ---
echo
echo "[$(elapsed) s] summary"
timeout 60 "$PY" - "$OUT" <<'PY'
import glob, json, os, sys
import xml.etree.ElementTree as ET

out = sys.argv[1]
summary = {"steps": [], "parity": {}, "ling3_1b": {}, "long_seq": None}
with open(os.path.join(out, "steps.tsv")) as f:
    next(f)
    for line in f:
        name, rc, wall, limit = line.rstrip("\n").split("\t")
        summary["steps"].append({"step": name, "rc": rc, "wall_s": wall, "limit_s": limit})


def jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# parity: per-test outcomes (JUnit when pytest finished, else the plugin's records)
tests = {}
for record in jsonl(os.path.join(out, "parity", "outcomes.jsonl")):
    entry = tests.setdefault(record["test"], {"outcome": "started, no verdict (cut?)"})
    if record["event"] != "start":
        if record.get("outcome") != "passed" or entry["outcome"].startswith("started"):
            entry["outcome"] = record["outcome"] if record["event"] == "call" else \
                f"{record['outcome']} in {record['event']}"
        entry["seconds"] = record.get("seconds")
        if "detail" in record:
            entry["detail"] = record["detail"][-1500:]
for path in glob.glob(os.path.join(out, "parity", "junit_*.xml")):
    for case in ET.parse(path).getroot().iter("testcase"):
        entry = tests.setdefault(case.get("name"), {})
        entry["junit"] = next((tag for tag in ("failure", "error", "skipped")
                               if case.find(tag) is not None), "passed")
        entry.setdefault("seconds", float(case.get("time", 0)))
figures = {}
for record in jsonl(os.path.join(out, "parity", "figures.jsonl")):
    figures[record.pop("test")] = record
summary["parity"] = {"tests": tests, "figures": figures}
for engine in ("fsdp", "megatron"):
    path = os.path.join(out, f"train_engine_ling3-1b_{engine}.json")
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        summary["ling3_1b"][engine] = {"card": data.get("device"), "tokens": data.get("tokens"),
                                       **next(iter(data.get("results", {}).values()), {})}
    else:
        summary["ling3_1b"][engine] = {"error": "no results JSON (see its log)"}
path = os.path.join(out, "long_seq", "summary.json")
if os.path.exists(path):
    with open(path) as f:
        summary["long_seq"] = json.load(f)
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2, default=str)

print("steps:")
for s in summary["steps"]:
    print(f"  {s['step']:<22} rc {s['rc']:<8} {s['wall_s']:>4} s of {s['limit_s']} s")
print("parity (tests/gpu/test_bailing_gpu.py):")
for name, entry in tests.items():
    print(f"  {entry.get('junit') or entry.get('outcome'):<10} {name} "
          f"({entry.get('seconds', '?')} s)")
    if "detail" in entry and entry.get("junit", entry.get("outcome")) != "passed":
        lines = [l for l in entry["detail"].splitlines() if l.strip()]
        print("      " + "\n      ".join(lines[-4:]))
for name, record in figures.items():
    shown = {k: (f"{v:.3e}" if isinstance(v, float) else v) for k, v in record.items()
             if k != "errors"}
    print(f"  figures {name}: {shown}")
print("ling3-1b throughput (8 sequences, 512-4096 tokens):")
for engine, r in summary["ling3_1b"].items():
    if "step_s" in r:
        print(f"  {engine:<9} {r['step_s']:.3f} s/step  {r['tokens_per_s']:.0f} tokens/s  "
              f"MFU {100 * r['mfu']:.1f} %  peak {r['peak_mem_gb']:.1f} GiB  "
              f"warm-up {[round(t, 1) for t in r.get('warmup_step_s') or []]} s  "
              f"({r.get('card')})")
    else:
        print(f"  {engine:<9} {r.get('error', 'no timed step')}")
long = summary["long_seq"]
print("Qwen2-0.5B longest sequence at c1 (FSDP, chunked log-probs, activation checkpointing):")
if long:
    for run in long["runs"]:
        if run["outcome"] == "trained":
            print(f"  {run['length']:>8} tokens: {run['tokens_per_s']:.0f} tokens/s, MFU "
                  f"{100 * run['mfu']:.1f} %, peak {run['peak_mem_gb']:.1f} GiB, "
                  f"{run['step_s']:.2f} s/step (warm-up steps {run['warmup_steps']})")
        else:
            print(f"  {run['length']:>8} tokens: {run['outcome']}")
    print(f"  longest trained: {long['longest_trained']}; stopped: {long['stopped']}; "
          f"card {long['card']}")
else:
    print("  no result (see logs/long_seq.log)")
print(f"wrote {os.path.join(out, 'summary.json')}")
PY
# The device tool brings back at most 8 files: FLASH_V3_PACK_TO gets the summary and one
# archive of everything under $OUT.
if [[ -n ${FLASH_V3_PACK_TO:-} ]]; then
    mkdir -p "$FLASH_V3_PACK_TO" &&
        cp "$OUT/summary.json" "$FLASH_V3_PACK_TO/" &&
        tar czf "$FLASH_V3_PACK_TO/flash_v3_out.tar.gz" -C "$OUT" .
    # the compiled and tuned kernels, to seed a later run (FLASH_V3_TRITON_SEED)
    tar czf "$SCRATCH/triton_cache.tar.gz" -C "$TRITON_CACHE_DIR" . &&
        if (($(stat -c %s "$SCRATCH/triton_cache.tar.gz") < 15 * 1024 * 1024)); then
            cp "$SCRATCH/triton_cache.tar.gz" "$FLASH_V3_PACK_TO/"
        else
            echo "Triton cache too large to come back: $(du -h "$SCRATCH/triton_cache.tar.gz")"
        fi
fi
echo "[$(elapsed) s] done; logs in $LOGS, results in $OUT"
exit 0
