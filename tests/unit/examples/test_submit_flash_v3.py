"""submit_arena_flash_v3.sh: node profiles, budgets, path checks and hand-off (cases 40-47).

Most cases run the wrapper inside a fake checkout whose ``submit_arena.sh`` is a bash stub
that records its argv and environment. One case hands off to the real submit_arena.sh
(stub sbatch) and resolves arena_flash_v3.yaml with the submitted environment to check
what the workers receive (README_arena.md#environment).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from areal.api.alloc_mode import ModelAllocation
from areal.api.cli_args import load_expr_config
from examples.swe.utils import SWEPPOConfig
from tests.conftest import REPO_ROOT, SECRET_SENTINEL, SWE_DIR
from tests.unit.examples.test_submit_arena import read_calls, write_stub

WRAPPER = SWE_DIR / "submit_arena_flash_v3.sh"
DATASET = "examples/swe/dataset_configs/flash-v3-multi-stream.yaml"
MINI_DATASET = "examples/swe/dataset_configs/flash-v3-mini-streams.yaml"
MINI_YAML = "examples/swe/arena_flash_v3_mini.yaml"
FLASH_YAML = "examples/swe/arena_flash_v3.yaml"

# N_NODES -> (actor, rollout) layouts the wrapper picks.
PROFILES = {
    "2": ("megatron:(attn:d1p2t4c2|ffn:d1p2e8)", "sglang:d4t4p1"),
    "4": ("megatron:(attn:d2p2t4c2|ffn:d2p2e8)", "sglang:d8t4p1"),
    "8": ("megatron:(attn:d2p2t2c8|ffn:d4p2e8)", "sglang:d16t4p1"),
    "16": ("megatron:(attn:d4p2t2c8|ffn:d8p2e8)", "sglang:d32t4p1"),
}
# Everything the wrapper reads; the tests start without any of them.
KNOBS = (
    "N_NODES",
    "ACTOR_BACKEND",
    "ROLLOUT_BACKEND",
    "TRAIN_BATCH_SIZE",
    "N_SAMPLES",
    "TOTAL_TRAIN_STEPS",
    "MAX_CONCURRENT_ROLLOUTS",
    "CONTEXT_LENGTH",
    "MAX_TOKENS",
    "MAX_NEW_TOKENS",
    "ACTOR_MAX_TOKENS_PER_MB",
    "AREAL_DIR",
    "CONFIG_PATH",
    "DATASET_CONFIG",
    "ROLLOUT_IMAGE",
    "AWEX_ROOT",
    "FLASH_LINEAR_ATTENTION_ROOT",
    "FLASH_V3_SHAPE",
    "RECOVER_MODE",
    "RECOVER_FREQ_STEPS",
)
# A stand-in for submit_arena.sh (the wrapper runs it with bash): NUL-separated records.
SUBMIT_STUB = """#!/usr/bin/env bash
for arg in "$@"; do printf '%s\\0' "$arg"; done > "$(dirname "$0")/handoff.argv"
env -0 > "$(dirname "$0")/handoff.env"
"""


def profile_lines(
    nodes: str = "8",
    *,
    context: int = 131072,
    max_tokens: int = 131071,
    max_new_tokens: int = 131071,
    batch: str = "32",
    samples: str = "12",
    steps: str = "500",
    concurrency: str = "1500",
) -> list[str]:
    """The 10 lines ``--print-profile`` prints, in order."""
    actor, rollout = PROFILES[nodes]
    return [
        f"nodes={nodes}",
        f"actor={actor}",
        f"rollout={rollout}",
        f"context={context}",
        f"max_tokens={max_tokens}",
        f"max_new_tokens={max_new_tokens}",
        f"batch={batch}",
        f"samples={samples}",
        f"steps={steps}",
        f"concurrency={concurrency}",
    ]


class Checkout:
    """A fake shared checkout holding the real wrapper and a recording submit_arena.sh."""

    def __init__(self, root: Path):
        self.root = root
        self.dir = root / "checkout"
        swe = self.dir / "examples" / "swe"
        (swe / "dataset_configs").mkdir(parents=True)
        self.wrapper = Path(shutil.copy(WRAPPER, swe / WRAPPER.name))
        shutil.copy(REPO_ROOT / DATASET, self.dir / DATASET)
        shutil.copy(REPO_ROOT / MINI_DATASET, self.dir / MINI_DATASET)
        (swe / "submit_arena.sh").write_text(SUBMIT_STUB)
        self.handoff = swe / "handoff"
        self.rollout_image = root / "images" / "sglang.sif"
        self.rollout_image.parent.mkdir()
        self.rollout_image.write_bytes(b"SIF")
        self.awex = root / "src" / "awex"
        self.fla = root / "src" / "fla"
        self.awex.mkdir(parents=True)
        self.fla.mkdir(parents=True)

    def env(self, **changes: str | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in KNOBS}
        env.update(
            ROLLOUT_IMAGE=str(self.rollout_image),
            AWEX_ROOT=str(self.awex),
            FLASH_LINEAR_ATTENTION_ROOT=str(self.fla),
        )
        for name, value in changes.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def run(self, *args: str, script: Path | None = None, **changes: str | None):
        command = [str(script or self.wrapper), *args]
        env = self.env(**changes)
        return subprocess.run(command, cwd=self.root, env=env, capture_output=True, text=True)

    def handed_off(self) -> tuple[list[str], dict[str, str]] | None:
        argv_file = self.handoff.with_suffix(".argv")
        if not argv_file.exists():
            return None
        argv = argv_file.read_bytes().split(b"\0")[:-1]
        pairs = self.handoff.with_suffix(".env").read_bytes().split(b"\0")[:-1]
        env = dict(pair.decode().split("=", 1) for pair in pairs)
        return [a.decode() for a in argv], env


@pytest.fixture
def checkout(tmp_path: Path) -> Checkout:
    return Checkout(tmp_path)


def print_profile(checkout: Checkout, **changes: str | None) -> subprocess.CompletedProcess:
    # --print-profile needs none of the Flash paths.
    paths = dict.fromkeys(("ROLLOUT_IMAGE", "AWEX_ROOT", "FLASH_LINEAR_ATTENTION_ROOT"))
    return checkout.run("--print-profile", **{**paths, **changes})


# --- case 40: --print-profile for every node count ---


@pytest.mark.parametrize("nodes", ["2", "4", "8", "16"])
def test_print_profile_for_each_node_count(checkout, nodes):
    done = print_profile(checkout, N_NODES=nodes)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == profile_lines(nodes)
    assert done.stdout.endswith("\n") and done.stderr == ""
    assert checkout.handed_off() is None  # nothing submitted


def test_print_profile_for_two_nodes_matches_the_spec_verbatim(checkout):
    done = print_profile(checkout, N_NODES="2")
    assert done.stdout == (
        "nodes=2\n"
        "actor=megatron:(attn:d1p2t4c2|ffn:d1p2e8)\n"
        "rollout=sglang:d4t4p1\n"
        "context=131072\n"
        "max_tokens=131071\n"
        "max_new_tokens=131071\n"
        "batch=32\n"
        "samples=12\n"
        "steps=500\n"
        "concurrency=1500\n"
    )


def test_print_profile_defaults_to_eight_nodes(checkout):
    done = print_profile(checkout)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == profile_lines("8")


def test_print_profile_checks_no_path(checkout):
    # Paths that would all fail the non-print checks are ignored.
    done = print_profile(
        checkout,
        ROLLOUT_IMAGE="/nonexistent/sglang.sif",
        AWEX_ROOT="/nonexistent/awex",
        DATASET_CONFIG="/nonexistent/streams.yaml",
        AREAL_DIR="/nonexistent/checkout",
    )
    assert done.returncode == 0, done.stderr
    assert checkout.handed_off() is None


@pytest.mark.parametrize("nodes", ["2", "4", "8", "16"])
def test_each_profile_fills_its_nodes(checkout, nodes):
    # The layouts the script prints: actor and colocated rollout both use exactly
    # N_NODES x 8 GPUs.
    done = print_profile(checkout, N_NODES=nodes)
    assert done.returncode == 0, done.stderr
    printed = dict(line.split("=", 1) for line in done.stdout.splitlines())
    actor = ModelAllocation.from_str(printed["actor"])
    rollout = ModelAllocation.from_str(printed["rollout"])
    assert actor.parallel.world_size == int(nodes) * 8
    assert rollout.n_instances * rollout.instance_size == int(nodes) * 8


# --- case 41: node count ---


@pytest.mark.parametrize("nodes", ["3", "abc", "32", "08"])
@pytest.mark.parametrize("args", [[], ["--print-profile"]])
def test_bad_node_count_exits_2(checkout, nodes, args):
    done = checkout.run(*args, N_NODES=nodes)
    assert done.returncode == 2
    assert "N_NODES must be 2, 4, 8 or 16" in done.stderr
    assert done.stdout == "" and checkout.handed_off() is None


# --- cases 42-43: token budgets ---


@pytest.mark.parametrize("value", ["1", "0", "012", "x", "-4", "4096.0", "1" * 19])
def test_bad_context_length_exits_2(checkout, value):
    done = print_profile(checkout, CONTEXT_LENGTH=value)
    assert done.returncode == 2
    assert "CONTEXT_LENGTH must be an integer of at least 2" in done.stderr


def test_context_length_sets_the_default_budgets(checkout):
    done = print_profile(checkout, CONTEXT_LENGTH="4096")
    assert done.returncode == 0, done.stderr
    expected = profile_lines(context=4096, max_tokens=4095, max_new_tokens=4095)
    assert done.stdout.splitlines() == expected
    done = checkout.run(CONTEXT_LENGTH="4096")
    assert done.returncode == 0, done.stderr
    _, env = checkout.handed_off()
    assert (env["MAX_TOKENS"], env["MAX_NEW_TOKENS"]) == ("4095", "4095")
    assert env["ACTOR_MAX_TOKENS_PER_MB"] == "4096"


@pytest.mark.parametrize("name", ["MAX_TOKENS", "MAX_NEW_TOKENS"])
@pytest.mark.parametrize("value", ["131072", "200000", "0", "-1", "x", "0100"])
def test_bad_token_budget_exits_2(checkout, name, value):
    done = print_profile(checkout, **{name: value})
    assert done.returncode == 2
    assert f"{name} must be positive and smaller than CONTEXT_LENGTH" in done.stderr


def test_max_tokens_alone_sets_max_new_tokens(checkout):
    done = print_profile(checkout, MAX_TOKENS="100")
    assert done.stdout.splitlines() == profile_lines(max_tokens=100, max_new_tokens=100)
    done = print_profile(checkout, MAX_TOKENS="100", MAX_NEW_TOKENS="50")
    assert done.stdout.splitlines() == profile_lines(max_tokens=100, max_new_tokens=50)


def test_max_tokens_is_checked_before_max_new_tokens(checkout):
    done = print_profile(checkout, MAX_TOKENS="0", MAX_NEW_TOKENS="0")
    assert "MAX_TOKENS must be" in done.stderr and "MAX_NEW_TOKENS" not in done.stderr


# --- cases 44-45: overrides ---


def test_profile_overwrites_user_backends(checkout):
    mine = {"ACTOR_BACKEND": "fsdp:d8p1t1", "ROLLOUT_BACKEND": "sglang:d1t8p1"}
    done = print_profile(checkout, N_NODES="4", **mine)
    assert done.stdout.splitlines() == profile_lines("4")
    done = checkout.run(N_NODES="4", **mine)
    assert done.returncode == 0, done.stderr
    _, env = checkout.handed_off()
    assert (env["ACTOR_BACKEND"], env["ROLLOUT_BACKEND"]) == PROFILES["4"]


def test_budget_overrides_are_reflected(checkout):
    done = print_profile(
        checkout,
        TRAIN_BATCH_SIZE="4",
        N_SAMPLES="2",
        TOTAL_TRAIN_STEPS="1",
        MAX_CONCURRENT_ROLLOUTS="4",
    )
    assert done.returncode == 0, done.stderr
    expected = profile_lines(batch="4", samples="2", steps="1", concurrency="4")
    assert done.stdout.splitlines() == expected


# --- case 46: Flash inputs in non-print modes ---


@pytest.mark.parametrize("missing", ["ROLLOUT_IMAGE", "AWEX_ROOT", "FLASH_LINEAR_ATTENTION_ROOT"])
@pytest.mark.parametrize("value", [None, ""])
def test_missing_flash_input_exits_1(checkout, missing, value):
    done = checkout.run(**{missing: value})
    assert done.returncode == 1
    assert missing in done.stderr
    assert checkout.handed_off() is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ROLLOUT_IMAGE", "/nonexistent/sglang.sif"),
        ("DATASET_CONFIG", "/nonexistent/streams.yaml"),
        ("AWEX_ROOT", "/nonexistent/awex"),
        ("FLASH_LINEAR_ATTENTION_ROOT", "/nonexistent/fla"),
    ],
)
def test_unreadable_flash_input_exits_2(checkout, name, value):
    done = checkout.run(**{name: value})
    assert done.returncode == 2
    assert "missing/unreadable" in done.stderr and name in done.stderr
    assert checkout.handed_off() is None


def test_flash_roots_must_be_directories(checkout):
    done = checkout.run(AWEX_ROOT=str(checkout.rollout_image), FLASH_LINEAR_ATTENTION_ROOT=None)
    assert done.returncode == 1  # the missing variable is reported first
    done = checkout.run(
        AWEX_ROOT=str(checkout.rollout_image),
        FLASH_LINEAR_ATTENTION_ROOT=str(checkout.rollout_image),
        ROLLOUT_IMAGE=str(checkout.awex),
    )
    assert done.returncode == 2
    for name in ("AWEX_ROOT", "FLASH_LINEAR_ATTENTION_ROOT", "ROLLOUT_IMAGE"):
        assert name in done.stderr


# --- case 47: hand-off ---


@pytest.mark.parametrize("args", [[], ["--check-arena"]])
def test_hands_off_to_submit_arena_with_the_same_argument(checkout, args):
    done = checkout.run(*args)
    assert done.returncode == 0, done.stderr
    argv, env = checkout.handed_off()
    assert argv == args
    areal_dir = str(checkout.dir.resolve())
    assert env["AREAL_DIR"] == areal_dir  # default: two levels above the script
    assert env["CONFIG_PATH"] == f"{areal_dir}/{FLASH_YAML}"
    assert env["DATASET_CONFIG"] == f"{areal_dir}/{DATASET}"
    assert env["N_NODES"] == "8"
    assert (env["ACTOR_BACKEND"], env["ROLLOUT_BACKEND"]) == PROFILES["8"]
    budgets = {
        "TRAIN_BATCH_SIZE": "32",
        "N_SAMPLES": "12",
        "TOTAL_TRAIN_STEPS": "500",
        "MAX_CONCURRENT_ROLLOUTS": "1500",
        "CONTEXT_LENGTH": "131072",
        "MAX_TOKENS": "131071",
        "MAX_NEW_TOKENS": "131071",
        "ACTOR_MAX_TOKENS_PER_MB": "131072",
    }
    assert {k: env[k] for k in budgets} == budgets
    for name in ("ROLLOUT_IMAGE", "AWEX_ROOT", "FLASH_LINEAR_ATTENTION_ROOT"):
        assert env[name] == checkout.env()[name]


def test_hand_off_keeps_explicit_paths(checkout, tmp_path):
    streams = tmp_path / "my-streams.yaml"
    shutil.copy(REPO_ROOT / DATASET, streams)
    done = checkout.run(CONFIG_PATH="/shared/my-flash.yaml", DATASET_CONFIG=str(streams))
    assert done.returncode == 0, done.stderr
    _, env = checkout.handed_off()
    assert env["CONFIG_PATH"] == "/shared/my-flash.yaml"
    assert env["DATASET_CONFIG"] == str(streams)


def test_default_areal_dir_resolves_symlinks(checkout, tmp_path):
    link = tmp_path / "checkout-link"
    link.symlink_to(checkout.dir)
    script = link / "examples" / "swe" / WRAPPER.name
    done = checkout.run(script=script)
    assert done.returncode == 0, done.stderr
    _, env = checkout.handed_off()
    assert env["AREAL_DIR"] == str(checkout.dir.resolve())


@pytest.mark.parametrize("args", [["--controller"], ["--run"], ["--bogus"]])
def test_internal_and_unknown_arguments_exit_2(checkout, args):
    done = checkout.run(*args)
    assert done.returncode == 2
    assert "Unknown argument" in done.stderr
    assert checkout.handed_off() is None


def test_argument_count_and_help(checkout):
    done = checkout.run("--check-arena", "--print-profile")
    assert done.returncode == 2 and "at most one argument" in done.stderr
    done = checkout.run("--help", "--bogus", "more")
    assert done.returncode == 0
    usage = done.stdout
    assert usage.startswith("Usage: submit_arena_flash_v3.sh")
    for text in (
        "N_NODES selects 2, 4, 8 (default) or 16",
        "TRAIN_BATCH_SIZE=32",
        "N_SAMPLES=12",
        "CONTEXT_LENGTH=131072 (128K)",
        "TOTAL_TRAIN_STEPS=500",
        "two Arena Streams",
        "ROLLOUT_IMAGE",
        "AWEX_ROOT",
        "FLASH_LINEAR_ATTENTION_ROOT",
        "MODEL_PATH selects the Flash V3 checkpoint",
        "ACTOR_RUNTIME_PYTHONPATH",
        "ROLLOUT_RUNTIME_PYTHONPATH",
        "DATASET_CONFIG",
        "README_arena.md",
    ):
        assert text in usage, text


# --- sections 4.5-4.6: through the real submit_arena.sh to the workers' environment ---


@pytest.mark.parametrize("nodes", ["2", "16"])
def test_real_submission_gives_workers_the_flash_runtime(checkout, tmp_path, monkeypatch, nodes):
    log = tmp_path / "calls.jsonl"
    write_stub(tmp_path / "bin" / "sbatch", "sbatch", log, stdout="17\n")
    model = tmp_path / "models" / "flash-v3"
    model.mkdir(parents=True)
    credentials = tmp_path / "arena.env"
    credentials.write_text(f"export ARENA_OPENAPI_TOKEN={SECRET_SENTINEL}\n")
    fileroot = tmp_path / "fileroot"
    done = checkout.run(
        script=WRAPPER,  # the real checkout: hands off to the real submit_arena.sh
        N_NODES=nodes,
        ROLLOUT_RUNTIME_PYTHONPATH="/overlay/rollout",
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        AREAL_IMAGE=str(checkout.rollout_image),
        AREAL_PYTHON="/opt/venv/bin/python",
        MODEL_PATH=str(model),
        AREAL_FILEROOT=str(fileroot),
        ARENA_CREDENTIALS_FILE=str(credentials),
        AREAL_CONTROLLER_MOUNTS="/shared:/shared",
        AREAL_WORKER_MOUNTS="/shared:/shared",
        TRIAL_NAME="flash",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "17\n"
    [call] = read_calls(log, "sbatch")
    assert call["argv"][-2:] == [f"{REPO_ROOT}/examples/swe/submit_arena.sh", "--controller"]
    assert "--job-name=flash-controller" in call["argv"]
    submitted = call["env"]
    assert submitted["CONFIG_PATH"] == f"{REPO_ROOT}/{FLASH_YAML}"
    assert SECRET_SENTINEL not in repr(call)

    # What run mode resolves from that environment (after sourcing the credentials).
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in submitted.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SWE_RL_ADMIN_API_KEY", "admin-key")
    monkeypatch.setenv("ARENA_OPENAPI_BASE", "https://arena.example.test")
    cfg, _ = load_expr_config(["--config", submitted["CONFIG_PATH"]], SWEPPOConfig)
    assert cfg.cluster.n_nodes == int(nodes)
    assert (cfg.actor.backend, cfg.rollout.backend) == PROFILES[nodes]
    assert cfg.gconfig.max_tokens == cfg.gconfig.max_new_tokens == 131071
    assert cfg.econfig.arena_streams_file == f"{REPO_ROOT}/{DATASET}"
    fla, awex = str(checkout.fla), str(checkout.awex)
    common = {
        "AWEX_ROOT": awex,
        "AWEX_COLOCATE_TIMEOUT_S": "7200",
        "AREAL_AWEX_PROCESS_QUEUE_WHEN_IDLE": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "",
    }
    actor_spec, rollout_spec = cfg.actor.scheduling_spec[0], cfg.rollout.scheduling_spec[0]
    # No actor overlay leaves an empty PYTHONPATH component, reproduced as is.
    assert actor_spec.env_vars == {"PYTHONPATH": f"{REPO_ROOT}::{fla}:{awex}", **common}
    assert rollout_spec.env_vars == {
        "PYTHONPATH": f"{REPO_ROOT}:/overlay/rollout:{fla}:{awex}",
        **common,
    }
    prelude = [
        'set -a; source "$ARENA_CREDENTIALS_FILE"; set +a',
        "unset ALL_PROXY all_proxy HTTP_PROXY HTTPS_PROXY http_proxy https_proxy",
    ]
    assert actor_spec.additional_bash_cmds == rollout_spec.additional_bash_cmds == prelude
    assert rollout_spec.image == str(checkout.rollout_image)


# --- the CPU mini shape (FLASH_V3_SHAPE=cpu-mini): the profile's twin on one node ---

MINI_PROFILE = [
    "nodes=1",
    "actor=megatron:(attn:d1p1t2c2|ffn:d2p1t1e2)",
    "rollout=hf:d2p1t2",
    "context=1024",
    "max_tokens=1023",
    "max_new_tokens=64",
    "batch=2",
    "samples=2",
    "steps=2",
    "concurrency=8",
]


def test_print_profile_for_the_cpu_mini_shape(checkout):
    done = print_profile(checkout, FLASH_V3_SHAPE="cpu-mini", N_NODES="16")  # N_NODES unused
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == MINI_PROFILE


def test_unknown_shape_exits_2(checkout):
    done = print_profile(checkout, FLASH_V3_SHAPE="gpu-mini")
    assert done.returncode == 2
    assert "FLASH_V3_SHAPE must be 'nodes' or 'cpu-mini', got 'gpu-mini'" in done.stderr


def test_cpu_mini_hands_off_the_twin_and_its_streams(checkout):
    done = checkout.run("--check-arena", FLASH_V3_SHAPE="cpu-mini")
    assert done.returncode == 0, done.stderr
    argv, env = checkout.handed_off()
    assert argv == ["--check-arena"]
    areal_dir = str(checkout.dir.resolve())
    assert env["CONFIG_PATH"] == f"{areal_dir}/{MINI_YAML}"
    assert env["DATASET_CONFIG"] == f"{areal_dir}/{MINI_DATASET}"
    assert (env["RECOVER_MODE"], env["RECOVER_FREQ_STEPS"]) == ("auto", "1")
    assert env["ACTOR_MAX_TOKENS_PER_MB"] == "4096"


def test_cpu_mini_composed_config_keeps_every_flash_mechanism(checkout, monkeypatch):
    """What the CPU mini submission runs: awex updates, TP-2 servers colocated by fork on
    the actor, a hybrid Megatron actor with c >= 2 and e >= 2, the ling3 parsers, two
    Anthropic Streams with equal weights, a recover point every step, the budget rule."""
    from areal.api.config.support import unsupported
    from examples.swe.arena_config import load_arena_stream_configs

    done = checkout.run(FLASH_V3_SHAPE="cpu-mini")
    assert done.returncode == 0, done.stderr
    _, env = checkout.handed_off()
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CONFIG_PATH", f"{REPO_ROOT}/{MINI_YAML}")
    monkeypatch.setenv("DATASET_CONFIG", f"{REPO_ROOT}/{MINI_DATASET}")
    for name, value in {
        "AREAL_DIR": str(REPO_ROOT),
        "AREAL_IMAGE": str(checkout.rollout_image),
        "AREAL_PYTHON": "/opt/venv/bin/python",
        "MODEL_PATH": "/shared/models/tiny-ling3",
        "AREAL_FILEROOT": "/shared/fileroot",
        "SWE_RL_ADMIN_API_KEY": "admin-key",
        "ARENA_OPENAPI_BASE": "http://127.0.0.1:9",
    }.items():
        monkeypatch.setenv(name, value)
    cfg, _ = load_expr_config(["--config", f"{REPO_ROOT}/{MINI_YAML}"], SWEPPOConfig)
    assert unsupported(cfg) == []
    assert cfg.scheduler.type == "slurm"
    assert cfg.actor.weight_update_mode == "awex"
    strategy = cfg.rollout.scheduling_strategy
    assert (strategy.type, strategy.target, strategy.fork) == ("colocation", "actor", True)
    rollout = ModelAllocation.from_str(cfg.rollout.backend).parallel
    assert (rollout.dp_size, rollout.tp_size) == (2, 2)
    actor = ModelAllocation.from_str(cfg.actor.backend)
    assert actor.backend == "megatron"
    assert actor.parallel.cp_size >= 2 and actor.parallel.ep_size >= 2
    assert actor.parallel.world_size == rollout.dp_size * rollout.tp_size
    agent = cfg.rollout.agent
    assert (agent.tool_call_parser, agent.reasoning_parser) == ("ling3", "ling3")
    streams = load_arena_stream_configs(cfg.econfig)
    assert [s.llm_protocol for s in streams] == ["anthropic", "anthropic"]
    assert [s.sampling_weight for s in streams] == [1.0, 1.0]
    assert all(s.harness and s.expected_reward_ref.version for s in streams)
    assert (cfg.recover.mode, cfg.recover.freq_steps) == ("auto", 1)
    assert cfg.gconfig.max_tokens == cfg.sglang.context_length - 1 == 1023
    assert (cfg.gconfig.reward_normalization, cfg.gconfig.drop_incomplete_group) == (True, True)
    assert (cfg.train_dataset.batch_size, cfg.gconfig.n_samples, cfg.total_train_steps) == (
        2,
        2,
        2,
    )
