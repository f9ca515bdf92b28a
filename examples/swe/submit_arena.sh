#!/usr/bin/env bash
# Submit an Arena GRPO run to Slurm as one CPU-only controller job.
#
#   login host:  submit_arena.sh [--check-arena]   -> sbatch (1 node, 4 CPUs, 16G, 0 GPUs)
#   sbatch job:  submit_arena.sh --controller      -> $AREAL_CONTAINER_BIN exec ... --run
#   container:   submit_arena.sh --run             -> resolve config, preflight,
#                                                     preflight.json, exec the trainer
#
# The trainer (AReaL's Slurm scheduler) submits the GPU worker jobs itself; the controller
# reserves no GPU. Credentials live only in the file named by ARENA_CREDENTIALS_FILE, which
# is sourced inside the container (and again by every worker); no token ever travels as a
# command argument, through sbatch's environment, or into a log.
set -euo pipefail
set +x # never trace: a trace of run mode would print credential values

SCRIPT_NAME=submit_arena.sh
REQUIRED_VARS=(AREAL_DIR CONFIG_PATH AREAL_IMAGE AREAL_PYTHON MODEL_PATH AREAL_FILEROOT
  ARENA_CREDENTIALS_FILE AREAL_CONTROLLER_MOUNTS AREAL_WORKER_MOUNTS)
CREDENTIAL_VARS=(ARENA_OPENAPI_BASE ARENA_OPENAPI_TOKEN ARENA_LLM_API_KEY SWE_RL_ADMIN_API_KEY)
# Launch values that win over a credentials file which also sets them (run mode).
LAUNCH_VARS=(AREAL_DIR CONFIG_PATH AREAL_IMAGE AREAL_PYTHON MODEL_PATH AREAL_FILEROOT
  ARENA_CREDENTIALS_FILE AREAL_WORKER_MOUNTS TRIAL_NAME ARENA_SUBMISSION_DIR ARENA_CHECK_ONLY
  ARENA_STREAM_ID ARENA_OPENAPI_BASE ARENA_PREFLIGHT_MIN_TASKS SBATCH_TIMELIMIT)
PROXY_VARS=(ALL_PROXY all_proxy HTTP_PROXY HTTPS_PROXY http_proxy https_proxy)

usage() {
  cat <<'EOF'
Usage: submit_arena.sh [--check-arena | -h | --help]

Submit an Arena GRPO run to Slurm: one CPU-only controller job (1 node, 4 CPUs, 16G,
no GPU) that, inside the container, resolves the training config, checks every Arena
Stream (preflight), writes preflight.json and starts the trainer. The trainer then
submits the GPU worker jobs itself.

  (no argument)   submit the controller for full training
  --check-arena   submit a CPU-only validation job: config resolution and Arena
                  preflight only, no trainer and no GPU workers
  -h, --help      show this help

Required environment (absolute paths, identical inside every container):
  AREAL_IMAGE               controller and actor worker image (readable file)
  AREAL_PYTHON              interpreter inside the image (not checked on this host)
  MODEL_PATH                model checkpoint directory
  AREAL_FILEROOT            experiment storage (submissions/, logs/, name_resolve/)
  ARENA_CREDENTIALS_FILE    private env file exporting ARENA_OPENAPI_BASE,
                            ARENA_OPENAPI_TOKEN, ARENA_LLM_API_KEY, SWE_RL_ADMIN_API_KEY
  AREAL_CONTROLLER_MOUNTS   bind list of the controller container (shared storage,
                            Slurm client, munge, ...)
  AREAL_WORKER_MOUNTS       bind list added to every worker container

Optional environment (default):
  AREAL_DIR                 this checkout (two directories above this script)
  CONFIG_PATH               examples/swe/arena_grpo.yaml, relative to AREAL_DIR. It
                            selects the single-Stream (arena_grpo.yaml, needs
                            ARENA_STREAM_ID) or multi-Stream (arena_multi_stream.yaml)
                            profile and the GPU topology of the workers.
  TRIAL_NAME                arena-<YYYYmmdd>-<HHMMSS>-<pid>
  ARENA_STREAM_ID           the Stream of the single-Stream profile (none)
  AREAL_CONTAINER_BIN       apptainer (singularity also works)
  ARENA_CONTROLLER_TIME     01:30:00 (time limit of the controller job)
  SBATCH_TIMELIMIT          01:00:00 (time limit of the worker jobs)
  ARENA_PREFLIGHT_MIN_TASKS 1 (recent terminal tasks each Stream needs)
  SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_RESERVATION, other SBATCH_*  read by sbatch

Logs and the preflight report go to $AREAL_FILEROOT/submissions/$TRIAL_NAME/.

Credentials stay in the shared ARENA_CREDENTIALS_FILE; never pass a token or key as a
command argument or put it in a YAML.
EOF
}

die() {
  local status=$1
  shift
  printf '%s: %s\n' "$SCRIPT_NAME" "$*" >&2
  exit "$status"
}

# --- arguments ---

mode=submit
if (($# > 0)); then
  case "$1" in
    -h | --help)
      usage
      exit 0
      ;;
    --check-arena) mode=submit ;;
    --controller) mode=controller ;;
    --run) mode=run ;;
    *) die 2 "Unknown argument: $1 (see --help)" ;;
  esac
  (($# == 1)) || die 2 "expected at most one argument, got $# (see --help)"
fi

# Credentials come from ARENA_CREDENTIALS_FILE only, so tokens that happen to be in the
# caller's environment must not travel with sbatch --export=ALL into the job.
unset ARENA_OPENAPI_TOKEN ARENA_LLM_API_KEY SWE_RL_ADMIN_API_KEY

# --- prologue (every mode) ---

if [[ $mode == submit ]]; then
  # Before submission: sbatch runs a spooled copy, whose location says nothing.
  if [[ -z ${AREAL_DIR:-} ]]; then
    script_dir=$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")
    AREAL_DIR=$(cd -P -- "$script_dir/../.." && pwd -P)
  fi
  CONFIG_PATH=${CONFIG_PATH:-examples/swe/arena_grpo.yaml}
  TRIAL_NAME=${TRIAL_NAME:-arena-$(date +%Y%m%d-%H%M%S)-$$}
  ARENA_CHECK_ONLY=${1:-}
  export AREAL_DIR CONFIG_PATH TRIAL_NAME ARENA_CHECK_ONLY
fi

declare -A REQUIRED_HINT=(
  [AREAL_DIR]="the shared AReaL checkout"
  [CONFIG_PATH]="the training YAML (absolute or relative to AREAL_DIR)"
  [AREAL_IMAGE]="the controller/actor container image (.sif) on shared storage"
  [AREAL_PYTHON]="the Python interpreter inside the image"
  [MODEL_PATH]="the model checkpoint directory on shared storage"
  [AREAL_FILEROOT]="the shared experiment storage directory"
  [ARENA_CREDENTIALS_FILE]="the private env file exporting the Arena credentials"
  [AREAL_CONTROLLER_MOUNTS]="the bind list of the controller container"
  [AREAL_WORKER_MOUNTS]="the bind list added to worker containers"
)
for name in "${REQUIRED_VARS[@]}"; do
  [[ -n ${!name:-} ]] || die 1 "$name is not set: point it to ${REQUIRED_HINT[$name]}"
done
if [[ -z ${TRIAL_NAME:-} ]]; then
  die 1 "TRIAL_NAME is not set; --controller and --run are internal modes started by a submission"
fi
# shellcheck disable=SC2163 # export the variables named in the list
export "${REQUIRED_VARS[@]}" TRIAL_NAME
export SLURM_EXPORT_ENV=ALL
export SBATCH_TIMELIMIT=${SBATCH_TIMELIMIT:-01:00:00}

for name in AREAL_DIR AREAL_IMAGE MODEL_PATH AREAL_FILEROOT ARENA_CREDENTIALS_FILE; do
  [[ ${!name} == /* ]] || die 2 "$name must be an absolute shared path, got '${!name}'"
done
cd -- "$AREAL_DIR" 2>/dev/null || die 2 "AREAL_DIR '$AREAL_DIR' is missing/unreadable"

unreadable=()
[[ -f $CONFIG_PATH && -r $CONFIG_PATH ]] || unreadable+=("CONFIG_PATH=$CONFIG_PATH")
[[ -f $AREAL_IMAGE && -r $AREAL_IMAGE ]] || unreadable+=("AREAL_IMAGE=$AREAL_IMAGE")
[[ -d $MODEL_PATH ]] || unreadable+=("MODEL_PATH=$MODEL_PATH (not a directory)")
[[ -f $ARENA_CREDENTIALS_FILE && -r $ARENA_CREDENTIALS_FILE ]] ||
  unreadable+=("ARENA_CREDENTIALS_FILE=$ARENA_CREDENTIALS_FILE")
if ((${#unreadable[@]} > 0)); then
  die 2 "missing/unreadable inputs: ${unreadable[*]}"
fi

export ARENA_SUBMISSION_DIR="$AREAL_FILEROOT/submissions/$TRIAL_NAME"
mkdir -p -- "$ARENA_SUBMISSION_DIR"

# --- submit: one CPU-only controller job ---

if [[ $mode == submit ]]; then
  command -v sbatch >/dev/null || die 1 "sbatch not found on PATH (run this on a Slurm login node)"
  # Even inside an existing allocation this submits a separate controller job.
  exec sbatch --parsable --nodes=1 --ntasks=1 --cpus-per-task=4 --mem=16G --gres=gpu:0 \
    --time="${ARENA_CONTROLLER_TIME:-01:30:00}" --export=ALL \
    --job-name="$TRIAL_NAME-controller" --chdir="$AREAL_DIR" \
    --output="$ARENA_SUBMISSION_DIR/controller-%j.log" \
    "$AREAL_DIR/examples/swe/submit_arena.sh" --controller
fi

# --- controller: start the container (this script is sbatch's spooled copy) ---

if [[ $mode == controller ]]; then
  container_bin=${AREAL_CONTAINER_BIN:-apptainer}
  command -v "$container_bin" >/dev/null ||
    die 1 "container runtime '$container_bin' not found (set AREAL_CONTAINER_BIN)"
  # --no-eval: the runtime must not shell-evaluate environment values.
  exec "$container_bin" exec --no-eval --pid --writable-tmpfs \
    --bind "$AREAL_CONTROLLER_MOUNTS" "$AREAL_IMAGE" \
    bash "$AREAL_DIR/examples/swe/submit_arena.sh" --run
fi

# --- run: inside the controller container ---

declare -A launch=()
for name in "${LAUNCH_VARS[@]}"; do
  if [[ -v $name ]]; then
    launch[$name]=${!name}
  fi
done

# The file's own output and errors are discarded: a malformed line could echo a value.
# If sourcing ends the shell (errexit), the trap reports on the saved stderr (fd 3).
credentials_failed() {
  printf '%s: %s\n' "$SCRIPT_NAME" "sourcing ARENA_CREDENTIALS_FILE failed (its output is \
suppressed so that no value is printed; check the file with bash -n)" >&3
}
exec 3>&2
trap credentials_failed EXIT
set -a
# shellcheck source=/dev/null
source "$ARENA_CREDENTIALS_FILE" >/dev/null 2>&1
set +a
set +x
trap - EXIT
exec 3>&-

for name in "${!launch[@]}"; do
  export "$name=${launch[$name]}"
done

for name in "${CREDENTIAL_VARS[@]}"; do
  [[ -n ${!name:-} ]] ||
    die 1 "$name is empty: the credentials file ARENA_CREDENTIALS_FILE must export it"
done

# Environment of the controller and, through SLURM_EXPORT_ENV=ALL, of every worker.
export SLURM_EXPORT_ENV=ALL
unset "${PROXY_VARS[@]}"
export PYTHONPATH="$AREAL_DIR${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [[ $AREAL_PYTHON == */* ]]; then
  PATH="$(dirname -- "$AREAL_PYTHON"):$PATH"
fi
export PATH
export APPTAINER_BIND="$AREAL_WORKER_MOUNTS"
export SINGULARITY_BIND="$AREAL_WORKER_MOUNTS"

# Resolve the config exactly as training will, preflight its Streams in process (the
# Streams payload never enters argv or the environment) and write preflight.json.
"$AREAL_PYTHON" - "$CONFIG_PATH" <<'PY'
import base64
import dataclasses
import json
import os
import sys
from pathlib import Path

import yaml

from areal.api.cli_args import ConfigError, load_expr_config
from areal.api.config.support import refuse_unsupported
from examples.swe.arena_config import load_arena_stream_configs
from examples.swe.arena_preflight import validate_streams
from examples.swe.utils import SWEPPOConfig

config_path = sys.argv[1]
# A config the trainer cannot run is refused here, before Arena or any worker is contacted.
try:
    config, _ = load_expr_config(["--config", config_path], SWEPPOConfig)
    refuse_unsupported(config)
except ConfigError as e:
    sys.exit(f"submit_arena.sh: {config_path}: {e}")
if config.scheduler.type != "slurm" or config.econfig.dataset_source != "arena":
    raise ValueError(
        "submit_arena.sh needs a config with scheduler.type 'slurm' and econfig.dataset_source "
        f"'arena'; {config_path} has scheduler.type {config.scheduler.type!r} and "
        f"econfig.dataset_source {config.econfig.dataset_source!r}"
    )

streams = load_arena_stream_configs(config.econfig)
document = {"streams": [dataclasses.asdict(stream) for stream in streams]}
payload = base64.b64encode(yaml.safe_dump(document, sort_keys=False).encode()).decode()

raw_min_tasks = os.environ.get("ARENA_PREFLIGHT_MIN_TASKS")
try:
    min_terminal_tasks = 1 if raw_min_tasks is None else int(raw_min_tasks)
except ValueError:
    raise ValueError(
        f"ARENA_PREFLIGHT_MIN_TASKS must be an integer, got {raw_min_tasks!r}"
    ) from None

summary = validate_streams(
    streams_yaml_b64=payload,
    base_url=config.econfig.arena_base_url,
    min_terminal_tasks=min_terminal_tasks,
)
report = Path(os.environ["ARENA_SUBMISSION_DIR"]) / "preflight.json"
report.write_text(json.dumps({"streams": summary}, indent=2) + "\n", encoding="utf-8")
names = ", ".join(record["name"] for record in summary)
print(f"Arena preflight passed for {len(summary)} Stream(s) ({names}); report: {report}",
      file=sys.stderr)
PY

if [[ -n ${ARENA_CHECK_ONLY:-} ]]; then
  exit 0
fi
exec "$AREAL_PYTHON" -m examples.swe.train_swe_rl --config "$CONFIG_PATH"
