#!/usr/bin/env bash
# Flash V3 profile wrapper: choose the node topology and token budgets, check the Flash
# specific inputs, then hand off to submit_arena.sh with examples/swe/arena_flash_v3.yaml.
#
# Actor (Megatron) and rollout (SGLang, TP4 replicas) are colocated on the same N_NODES x 8
# GPUs; attention and FFN/MoE layers get separate parallel layouts of equal size.
set -euo pipefail
set +x # never trace: submit_arena.sh sources credentials further down the chain

SCRIPT_NAME=submit_arena_flash_v3.sh

usage() {
  cat <<'EOF'
Usage: submit_arena_flash_v3.sh [--print-profile | --check-arena | -h | --help]

Submit the Flash V3 Arena GRPO profile (examples/swe/arena_flash_v3.yaml) through
submit_arena.sh: a Megatron actor and SGLang rollout colocated on the same nodes.

  (no argument)     submit full training
  --check-arena     submit the CPU-only config and Arena preflight check (no GPU workers)
  --print-profile   print the resolved topology and budgets, then exit; checks no path,
                    contacts nothing and submits nothing
  -h, --help        show this help

Topology: N_NODES selects 2, 4, 8 (default) or 16 shared training/inference nodes of
8 GPUs each. FLASH_V3_SHAPE=cpu-mini instead runs the profile's mini twin
(examples/swe/arena_flash_v3_mini.yaml) on one node without GPUs: a Megatron actor of 4
ranks megatron:(attn:d1p1t2c2|ffn:d2p1t1e2), two colocated TP-2 embedded servers hf:d2p1t2,
2 prompts x 2 samples, 2 steps, a 1024-token context, 64 new tokens; CONFIG_PATH and
DATASET_CONFIG then default to the twin and dataset_configs/flash-v3-mini-streams.yaml.

Defaults (override through the environment): TRAIN_BATCH_SIZE=32 prompts per step,
N_SAMPLES=12 samples per prompt, CONTEXT_LENGTH=131072 (128K), MAX_TOKENS and
MAX_NEW_TOKENS = CONTEXT_LENGTH - 1, TOTAL_TRAIN_STEPS=500, MAX_CONCURRENT_ROLLOUTS=1500,
ACTOR_MAX_TOKENS_PER_MB = CONTEXT_LENGTH; two Arena Streams from DATASET_CONFIG.

Required in addition to submit_arena.sh's variables (see submit_arena.sh --help):
  ROLLOUT_IMAGE                Flash V3 SGLang runtime image (readable file)
  AWEX_ROOT                    AWEX checkout that registers the Flash V3 converter
  FLASH_LINEAR_ATTENTION_ROOT  flash-linear-attention sources compatible with Flash V3
MODEL_PATH selects the Flash V3 checkpoint (architecture BailingMoeV3ForCausalLM).

Optional:
  DATASET_CONFIG               Streams file (default
                               $AREAL_DIR/examples/swe/dataset_configs/flash-v3-multi-stream.yaml)
  ACTOR_RUNTIME_PYTHONPATH     PYTHONPATH overlay of the actor workers (default empty)
  ROLLOUT_RUNTIME_PYTHONPATH   PYTHONPATH overlay of the rollout workers (default empty)
  CONFIG_PATH                  default $AREAL_DIR/examples/swe/arena_flash_v3.yaml
  FLASH_V3_SHAPE               nodes (default: N_NODES decides) or cpu-mini (see Topology)
  RECOVER_MODE                 disabled (default) or auto: with RECOVER_FREQ_STEPS=N a
                               recover point every N steps, and resubmitting with the same
                               TRIAL_NAME resumes a killed run (cpu-mini: auto, every step)

See README_arena.md (Flash V3) for the runtime requirements and the differences from the
original recipe.
EOF
}

die() {
  local status=$1
  shift
  printf '%s: %s\n' "$SCRIPT_NAME" "$*" >&2
  exit "$status"
}

# A positive decimal integer without a leading zero; at most 18 digits so that bash
# arithmetic on it cannot overflow.
is_count() {
  [[ $1 =~ ^[1-9][0-9]{0,17}$ ]]
}

# --- arguments ---

if (($# > 0)); then
  case "$1" in
    -h | --help)
      usage
      exit 0
      ;;
    --print-profile | --check-arena) ;;
    *) die 2 "Unknown argument: $1 (see --help)" ;;
  esac
  (($# == 1)) || die 2 "expected at most one argument, got $# (see --help)"
fi

# --- node profile ---

# The profile decides the layout; values set by the user are overwritten on purpose.
FLASH_V3_SHAPE=${FLASH_V3_SHAPE:-nodes}
case "$FLASH_V3_SHAPE" in
  nodes)
    export N_NODES=${N_NODES:-8}
    case "$N_NODES" in
      2) actor='(attn:d1p2t4c2|ffn:d1p2e8)' rollout=d4t4p1 ;;
      4) actor='(attn:d2p2t4c2|ffn:d2p2e8)' rollout=d8t4p1 ;;
      8) actor='(attn:d2p2t2c8|ffn:d4p2e8)' rollout=d16t4p1 ;;
      16) actor='(attn:d4p2t2c8|ffn:d8p2e8)' rollout=d32t4p1 ;;
      *) die 2 "N_NODES must be 2, 4, 8 or 16, got '$N_NODES'" ;;
    esac
    export ACTOR_BACKEND="megatron:$actor"
    export ROLLOUT_BACKEND="sglang:$rollout"
    defaults=(32 12 500 1500 131072 '' '')
    ;;
  cpu-mini)
    # the mini twin: one node, no GPUs, the embedded server in SGLang's place
    export N_NODES=1
    export ACTOR_BACKEND='megatron:(attn:d1p1t2c2|ffn:d2p1t1e2)'
    export ROLLOUT_BACKEND=hf:d2p1t2
    export RECOVER_MODE=${RECOVER_MODE:-auto} RECOVER_FREQ_STEPS=${RECOVER_FREQ_STEPS:-1}
    # batch, samples, steps, concurrency, context, new tokens, tokens per micro-batch
    defaults=(2 2 2 8 1024 64 4096)
    ;;
  *) die 2 "FLASH_V3_SHAPE must be 'nodes' or 'cpu-mini', got '$FLASH_V3_SHAPE'" ;;
esac

# --- budgets ---

export TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-${defaults[0]}}
export N_SAMPLES=${N_SAMPLES:-${defaults[1]}}
export TOTAL_TRAIN_STEPS=${TOTAL_TRAIN_STEPS:-${defaults[2]}}
export MAX_CONCURRENT_ROLLOUTS=${MAX_CONCURRENT_ROLLOUTS:-${defaults[3]}}
export CONTEXT_LENGTH=${CONTEXT_LENGTH:-${defaults[4]}}
if ! is_count "$CONTEXT_LENGTH" || ((CONTEXT_LENGTH < 2)); then
  die 2 "CONTEXT_LENGTH must be an integer of at least 2, got '$CONTEXT_LENGTH'"
fi
# SGLang reserves one token when it checks prompt + completion against the context.
export MAX_TOKENS=${MAX_TOKENS:-$((CONTEXT_LENGTH - 1))}
if ! is_count "$MAX_TOKENS" || ((MAX_TOKENS >= CONTEXT_LENGTH)); then
  die 2 "MAX_TOKENS must be positive and smaller than CONTEXT_LENGTH ($CONTEXT_LENGTH), got '$MAX_TOKENS'"
fi
export MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-${defaults[5]:-$MAX_TOKENS}}
if ! is_count "$MAX_NEW_TOKENS" || ((MAX_NEW_TOKENS >= CONTEXT_LENGTH)); then
  die 2 "MAX_NEW_TOKENS must be positive and smaller than CONTEXT_LENGTH ($CONTEXT_LENGTH), got '$MAX_NEW_TOKENS'"
fi
export ACTOR_MAX_TOKENS_PER_MB=${ACTOR_MAX_TOKENS_PER_MB:-${defaults[6]:-$CONTEXT_LENGTH}}

if [[ ${1:-} == --print-profile ]]; then
  printf '%s\n' \
    "nodes=$N_NODES" \
    "actor=$ACTOR_BACKEND" \
    "rollout=$ROLLOUT_BACKEND" \
    "context=$CONTEXT_LENGTH" \
    "max_tokens=$MAX_TOKENS" \
    "max_new_tokens=$MAX_NEW_TOKENS" \
    "batch=$TRAIN_BATCH_SIZE" \
    "samples=$N_SAMPLES" \
    "steps=$TOTAL_TRAIN_STEPS" \
    "concurrency=$MAX_CONCURRENT_ROLLOUTS"
  exit 0
fi

# --- paths ---

if [[ -z ${AREAL_DIR:-} ]]; then
  script_dir=$(dirname -- "$(readlink -f -- "${BASH_SOURCE[0]}")")
  AREAL_DIR=$(cd -P -- "$script_dir/../.." && pwd -P)
fi
export AREAL_DIR
if [[ $FLASH_V3_SHAPE == cpu-mini ]]; then
  profile=arena_flash_v3_mini.yaml streams=flash-v3-mini-streams.yaml
else
  profile=arena_flash_v3.yaml streams=flash-v3-multi-stream.yaml
fi
export CONFIG_PATH=${CONFIG_PATH:-$AREAL_DIR/examples/swe/$profile}
export DATASET_CONFIG=${DATASET_CONFIG:-$AREAL_DIR/examples/swe/dataset_configs/$streams}

[[ -n ${ROLLOUT_IMAGE:-} ]] || die 1 "ROLLOUT_IMAGE is not set: point it to the Flash V3 SGLang runtime image"
[[ -n ${AWEX_ROOT:-} ]] || die 1 "AWEX_ROOT is not set: point it to an AWEX checkout with the Flash V3 converter"
[[ -n ${FLASH_LINEAR_ATTENTION_ROOT:-} ]] ||
  die 1 "FLASH_LINEAR_ATTENTION_ROOT is not set: point it to compatible flash-linear-attention sources"
export ROLLOUT_IMAGE AWEX_ROOT FLASH_LINEAR_ATTENTION_ROOT

unreadable=()
[[ -f $ROLLOUT_IMAGE && -r $ROLLOUT_IMAGE ]] || unreadable+=("ROLLOUT_IMAGE=$ROLLOUT_IMAGE")
[[ -f $DATASET_CONFIG && -r $DATASET_CONFIG ]] || unreadable+=("DATASET_CONFIG=$DATASET_CONFIG")
[[ -d $AWEX_ROOT ]] || unreadable+=("AWEX_ROOT=$AWEX_ROOT (not a directory)")
[[ -d $FLASH_LINEAR_ATTENTION_ROOT ]] ||
  unreadable+=("FLASH_LINEAR_ATTENTION_ROOT=$FLASH_LINEAR_ATTENTION_ROOT (not a directory)")
if ((${#unreadable[@]} > 0)); then
  die 2 "missing/unreadable inputs: ${unreadable[*]}"
fi

# --- hand-off: every requirement of submit_arena.sh applies from here ---

exec bash "$AREAL_DIR/examples/swe/submit_arena.sh" "$@"
