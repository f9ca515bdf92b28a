"""The Arena YAML profiles compose with Hydra and validate as SWEPPOConfig (cases 48-53)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from areal.api.alloc_mode import ModelAllocation
from areal.api.cli_args import ConfigError, load_expr_config
from areal.utils.paths import get_log_path
from examples.swe.utils import ArenaRewardRefConfig, ArenaStreamConfig, SWEPPOConfig
from tests.conftest import SECRET_SENTINEL, SWE_DIR


def load(profile: str, *overrides: str) -> SWEPPOConfig:
    cfg, path = load_expr_config(["--config", str(SWE_DIR / profile), *overrides], SWEPPOConfig)
    assert Path(path) == SWE_DIR / profile
    return cfg


# --- case 48: arena_grpo ---


def test_arena_grpo_resolves_with_defaults(profile_env):
    cfg = load("arena_grpo.yaml")
    fileroot = profile_env["AREAL_FILEROOT"]
    assert cfg.gconfig.max_tokens == 32767
    assert cfg.sglang.context_length == 32768
    assert cfg.econfig.stream_id == ""
    assert cfg.trial_name == "smoke"
    assert cfg.econfig.arena_result_dump_dir == f"{fileroot}/arena-grpo/smoke/arena_results"
    # A sample of the profile's other keys, resolved through interpolations.
    assert cfg.rollout.backend == "sglang:d4p1t2"
    assert cfg.actor.backend == "fsdp:d8p1t1"
    assert cfg.ref.backend == "fsdp:d8p1t1"
    assert cfg.rollout.consumer_batch_size == 8
    assert cfg.rollout.agent.engine_max_tokens == 32767
    assert cfg.actor.reward_norm.group_size == 2
    assert cfg.actor.temperature == 1.0
    assert cfg.actor.max_new_tokens == 8192
    assert cfg.actor.optimizer.lr == pytest.approx(6e-6)
    assert cfg.actor.optimizer.eps == pytest.approx(1e-8)
    assert cfg.ref.optimizer is None
    assert cfg.ref.scheduling_strategy.type == "colocation"
    assert cfg.tokenizer_path == "/shared/models/qwen3-4b"
    assert cfg.sglang.model_path == "/shared/models/qwen3-4b"
    assert cfg.sglang.random_seed == 1
    assert cfg.cluster.name_resolve.nfs_record_root == f"{fileroot}/name_resolve"
    spec = cfg.actor.scheduling_spec[0]
    assert spec.cmd == "/opt/venv/bin/python -m areal.infra.rpc.rpc_server"
    assert spec.env_vars == {"PYTHONPATH": "/shared/src/areal"}
    assert spec.additional_bash_cmds == [
        'set -a; source "$ARENA_CREDENTIALS_FILE"; set +a',
        "unset ALL_PROXY all_proxy HTTP_PROXY HTTPS_PROXY http_proxy https_proxy",
    ]
    assert cfg.rollout.scheduling_spec == cfg.actor.scheduling_spec
    assert cfg.econfig.arena_llm_route_mode == "session_gateway"
    assert cfg.econfig.arena_base_url == "https://arena.example.test"
    assert cfg.econfig.dataset_source == "arena"
    assert cfg.scheduler.type == "slurm"
    assert cfg.eval_gconfig == cfg.gconfig


def test_arena_grpo_reads_stream_and_trial_from_env(profile_env, monkeypatch):
    monkeypatch.setenv("ARENA_STREAM_ID", "stream-42")
    monkeypatch.setenv("TRIAL_NAME", "t7")
    cfg = load("arena_grpo.yaml")
    assert cfg.econfig.stream_id == "stream-42"
    assert cfg.trial_name == "t7"
    assert cfg.econfig.arena_result_dump_dir.endswith("/arena-grpo/t7/arena_results")


@pytest.mark.parametrize(
    "missing",
    [
        "AREAL_FILEROOT",
        "SWE_RL_ADMIN_API_KEY",
        "MODEL_PATH",
        "AREAL_IMAGE",
        "AREAL_PYTHON",
        "AREAL_DIR",
        "ARENA_OPENAPI_BASE",
    ],
)
def test_arena_grpo_fails_without_required_env(profile_env, monkeypatch, missing):
    monkeypatch.delenv(missing)
    with pytest.raises(ConfigError, match=f"environment variable {missing} is not set"):
        load("arena_grpo.yaml")


# --- case 49: arena_multi_stream ---


def test_multi_stream_inherits_grpo_and_ignores_stream_env(profile_env, monkeypatch):
    monkeypatch.setenv("ARENA_STREAM_ID", "should-be-ignored")
    base = load("arena_grpo.yaml")
    cfg = load("arena_multi_stream.yaml")
    assert cfg.econfig.stream_id == ""
    placeholder_ref = ArenaRewardRefConfig(key="your-reward", version="1.0.0")
    assert cfg.econfig.arena_streams == [
        ArenaStreamConfig(
            name="first",
            stream_id="your-first-stream",
            sampling_weight=1.0,
            harness="your-harness@version",
            expected_reward_ref=placeholder_ref,
        ),
        ArenaStreamConfig(
            name="second",
            stream_id="your-second-stream",
            sampling_weight=1.0,
            harness="your-harness@version",
            expected_reward_ref=placeholder_ref,
        ),
    ]
    assert isinstance(cfg.econfig.arena_streams[0].expected_reward_ref.version, str)
    # Everything outside econfig is exactly arena_grpo's.
    for section in (
        "gconfig",
        "rollout",
        "actor",
        "ref",
        "sglang",
        "vllm",
        "cluster",
        "train_dataset",
        "valid_dataset",
        "saver",
        "recover",
        "stats_logger",
    ):
        assert getattr(cfg, section) == getattr(base, section), section
    assert cfg.econfig.arena_result_dump_dir == base.econfig.arena_result_dump_dir


# --- case 50: arena_flash_v3 ---


def test_flash_v3_resolves_with_defaults(profile_env):
    cfg = load("arena_flash_v3.yaml")
    assert cfg.gconfig.n_samples == 12
    assert cfg.gconfig.max_tokens == 131071
    assert cfg.gconfig.max_new_tokens == 131071
    assert cfg.sglang.context_length == 131072
    assert cfg.train_dataset.batch_size == 32
    assert cfg.train_dataset.max_length == 131072
    assert cfg.train_dataset.drop_last is True
    assert cfg.total_train_steps == 500
    assert cfg.total_train_epochs == 1000
    assert cfg.cluster.n_nodes == 8
    assert cfg.rollout.backend == "sglang:d16t4p1"
    assert cfg.actor.backend == "megatron:(attn:d2p2t2c8|ffn:d4p2e8)"
    assert cfg.rollout.max_concurrent_rollouts == 1500
    assert cfg.seed == 42
    assert cfg.valid_dataset is None
    assert cfg.actor.reward_norm is None
    assert cfg.gconfig.reward_normalization is True
    assert cfg.rollout.scheduling_strategy.type == "colocation"
    assert cfg.rollout.scheduling_strategy.target == "actor"
    assert cfg.rollout.scheduling_strategy.fork is True
    assert cfg.econfig.arena_streams_file == profile_env["DATASET_CONFIG"]
    assert cfg.rollout.scheduling_spec[0].image == "/shared/images/sglang.sif"
    assert cfg.actor.scheduling_spec[0].image == "/shared/images/areal.sif"
    assert cfg.rollout.scheduling_spec[0].env_vars["PYTHONPATH"] == (
        "/shared/src/areal::/shared/src/fla:/shared/src/awex"
    )
    assert cfg.actor.optimizer.warmup_steps == 5
    assert cfg.actor.optimizer.warmup_steps_proportion == pytest.approx(0.001)


def test_flash_v3_effective_merge_with_grpo(profile_env):
    cfg = load("arena_flash_v3.yaml")
    rs = cfg.actor.rejection_sampling
    assert (rs.level, rs.action, rs.metric, rs.upper, rs.lower) == (
        "token",
        "mask",
        "ratio",
        5.0,
        0.5,
    )
    assert cfg.actor.mb_spec.packing_algorithm == "ffd"
    assert cfg.actor.mb_spec.max_tokens_per_mb == 131072
    assert cfg.ref.backend == cfg.actor.backend
    assert cfg.ref.scheduling_strategy.type == "colocation"
    assert cfg.ref.optimizer is None
    assert cfg.ref.mb_spec.n_mbs == cfg.actor.mb_spec.n_mbs
    assert cfg.ref.mb_spec.max_tokens_per_mb == 131072
    assert cfg.ref.mb_spec.packing_algorithm == "ffd"
    agent = cfg.rollout.agent
    assert (agent.mode, agent.export_style, agent.chat_template_type) == (
        "inline",
        "concat",
        "concat",
    )
    assert agent.turn_discount == 1.0
    assert agent.admin_api_key == SECRET_SENTINEL
    assert agent.tool_call_parser == "ling3"
    assert agent.message_preprocessors == [
        "examples.swe.preprocessors.StripAnthropicBillingHeader",
        "examples.swe.preprocessors.StripAllSystemReminders",
        "examples.swe.preprocessors.StripAnthropicCacheFields",
        "examples.swe.preprocessors.NormalizeToolCallArguments",
    ]
    assert agent.session_timeout_seconds == 7200
    assert cfg.rollout.enable_rollout_tracing and cfg.rollout.dump_to_file
    assert cfg.rollout.queue_size is None
    assert cfg.scheduler.type == "slurm"
    assert cfg.econfig.dataset_source == "arena"
    assert cfg.econfig.arena_task_envs == {
        "ANTHROPIC_CUSTOM_HEADERS": "x-keepalive-enable: true",
        "CLAUDE_ENABLE_STREAM_WATCHDOG": "0",
        "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",
    }
    assert cfg.actor.gae_lambda == "areal.trainer.ppo.lambda_fn.vapo_length_adaptive_gae"
    assert cfg.actor.gae_lambda_kwargs == {"alpha": 1.5}
    assert cfg.actor.prox_logp_method == "reuse_train_logp"
    assert cfg.actor.megatron.ddp.overlap_grad_reduce is True
    assert cfg.eval_gconfig.n_samples == 12
    assert cfg.eval_gconfig.reward_normalization is False
    assert cfg.eval_gconfig.drop_incomplete_group is True
    # The profile's parallel layout fills 8 nodes x 8 GPUs for both engines (colocated).
    actor = ModelAllocation.from_str(cfg.actor.backend).parallel
    rollout = ModelAllocation.from_str(cfg.rollout.backend)
    assert actor.world_size == 64
    assert rollout.n_instances * rollout.instance_size == 64


def test_flash_v3_rollout_overlay_pythonpath(profile_env, monkeypatch):
    monkeypatch.setenv("ROLLOUT_RUNTIME_PYTHONPATH", "/overlay")
    cfg = load("arena_flash_v3.yaml")
    assert cfg.rollout.scheduling_spec[0].env_vars["PYTHONPATH"] == (
        "/shared/src/areal:/overlay:/shared/src/fla:/shared/src/awex"
    )
    assert cfg.actor.scheduling_spec[0].env_vars["PYTHONPATH"] == (
        "/shared/src/areal::/shared/src/fla:/shared/src/awex"
    )


@pytest.mark.parametrize(
    "missing", ["ROLLOUT_IMAGE", "FLASH_LINEAR_ATTENTION_ROOT", "AWEX_ROOT", "DATASET_CONFIG"]
)
def test_flash_v3_requires_its_env(profile_env, monkeypatch, missing):
    monkeypatch.delenv(missing)
    with pytest.raises(ConfigError, match=missing):
        load("arena_flash_v3.yaml")


# --- case 51: typed env overrides ---


def test_flash_v3_env_values_are_typed(profile_env, monkeypatch):
    monkeypatch.setenv("CONTEXT_LENGTH", "65536")
    monkeypatch.setenv("TRAIN_BATCH_SIZE", "4")
    monkeypatch.setenv("ARENA_DATASET_SHUFFLE", "false")
    monkeypatch.setenv("SGLANG_DISABLE_CUDA_GRAPH", "true")
    cfg = load("arena_flash_v3.yaml")
    assert cfg.sglang.context_length == 65536 and type(cfg.sglang.context_length) is int
    assert cfg.train_dataset.max_length == 65536
    assert cfg.train_dataset.batch_size == 4 and type(cfg.train_dataset.batch_size) is int
    assert cfg.rollout.consumer_batch_size == 4
    assert cfg.train_dataset.shuffle is False
    assert cfg.sglang.disable_cuda_graph is True


def test_flash_v3_rejects_a_non_numeric_env_value(profile_env, monkeypatch):
    monkeypatch.setenv("TRAIN_BATCH_SIZE", "thirty-two")
    with pytest.raises(ConfigError, match=r"train_dataset\.batch_size"):
        load("arena_flash_v3.yaml")


# --- case 52: the saved config.yaml is redacted ---


def _saved_config(cfg: SWEPPOConfig) -> tuple[str, dict]:
    path = (
        get_log_path(cfg.stats_logger.fileroot, cfg.experiment_name, cfg.trial_name) / "config.yaml"
    )
    text = path.read_text()
    return text, yaml.safe_load(text)


def test_saved_config_redacts_secrets(profile_env):
    payload = base64.b64encode(b"streams:\n- name: a\n  stream_id: s\n").decode()
    cfg = load(
        "arena_grpo.yaml",
        f"econfig.arena_streams_yaml_b64='{payload}'",  # quoted: base64 may end in '='
        f"stats_logger.wandb.wandb_api_key={SECRET_SENTINEL}-wandb",
        f"+econfig.arena_task_envs.GITHUB_TOKEN={SECRET_SENTINEL}-gh",
    )
    assert cfg.rollout.agent.admin_api_key == SECRET_SENTINEL  # the live value is intact
    assert cfg.econfig.arena_streams_yaml_b64 == payload
    text, saved = _saved_config(cfg)
    assert SECRET_SENTINEL not in text
    assert payload not in text
    assert saved["rollout"]["agent"]["admin_api_key"] == "<redacted>"
    assert saved["rollout"]["admin_api_key"] == ""  # unset: generated per run, never saved
    assert saved["stats_logger"]["wandb"]["wandb_api_key"] == "<redacted>"
    assert saved["econfig"]["arena_streams_yaml_b64"] == "<redacted>"
    assert saved["econfig"]["arena_task_envs"]["GITHUB_TOKEN"] == "<redacted>"
    # Non-secret values survive, in declaration order.
    assert saved["experiment_name"] == "arena-grpo"
    assert list(saved)[:2] == ["experiment_name", "trial_name"]
    assert saved["actor"]["backend"] == "fsdp:d8p1t1"


def test_saved_config_keeps_empty_secrets_visible(profile_env):
    cfg = load("arena_grpo.yaml")
    _, saved = _saved_config(cfg)
    assert saved["econfig"]["arena_streams_yaml_b64"] == ""
    assert saved["stats_logger"]["wandb"]["wandb_api_key"] == ""


def test_only_rank_zero_saves(profile_env, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    cfg = load("arena_grpo.yaml")
    path = get_log_path(
        cfg.stats_logger.fileroot, cfg.experiment_name, cfg.trial_name, create=False
    )
    assert not (path / "config.yaml").exists()


def test_secret_never_in_config_repr(profile_env):
    cfg = load("arena_grpo.yaml")
    assert SECRET_SENTINEL not in repr(cfg)
    assert SECRET_SENTINEL not in str(cfg)
    assert SECRET_SENTINEL not in f"{cfg.rollout.agent}"


# --- case 53: the Flash V3 dataset config ---


def test_flash_v3_dataset_config_types(profile_env):
    doc = yaml.safe_load((SWE_DIR / "dataset_configs" / "flash-v3-multi-stream.yaml").read_text())
    assert list(doc) == ["streams"]
    streams = [
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ArenaStreamConfig), entry))
        for entry in OmegaConf.create(doc)["streams"]
    ]
    assert [s.name for s in streams] == ["vn_greenfield", "favor_app_online_scratch"]
    assert [s.stream_id for s in streams] == [
        "vn-greenfield-fixed",
        "favor-app-online-scratch-fixed",
    ]
    assert [s.llm_protocol for s in streams] == ["anthropic", "anthropic"]
    assert [s.sampling_weight for s in streams] == [1.0, 1.0]
    assert [s.harness for s in streams] == [
        "flash-vn-agent@2.0.3",
        "claude-code@1.2.31-native-direct-sfx-260821",
    ]
    assert [(s.expected_reward_ref.key, s.expected_reward_ref.version) for s in streams] == [
        ("vn-creation-x2env-greenfield-reward", "2.0.8"),
        ("favor-app-online-scratch-reward", "2.0.2"),
    ]
    assert {s.reward_transform_fn for s in streams} == {
        "examples.swe.reward_transforms.identity_reward"
    }


# --- mini twins: each shipped profile has one that keeps its topology ---

MINI_TWINS = [
    ("arena_grpo.yaml", "arena_grpo_mini.yaml"),
    ("arena_multi_stream.yaml", "arena_multi_stream_mini.yaml"),
    ("arena_flash_v3.yaml", "arena_flash_v3_mini.yaml"),
]


def _topology(cfg: SWEPPOConfig) -> dict:
    rollout = ModelAllocation.from_str(cfg.rollout.backend).parallel
    actor = ModelAllocation.from_str(cfg.actor.backend)
    attn = actor.parallel  # a hybrid's attention degrees, with its ffn part's e
    strategy = cfg.rollout.scheduling_strategy
    agent = cfg.rollout.agent
    return {
        "rollout servers > 1": rollout.dp_size > 1,
        "rollout tp > 1": rollout.tp_size > 1,
        "rollout pp": rollout.pp_size,
        "actor engine": actor.backend,
        "actor ranks > 1": attn.world_size > 1,
        "actor model parallel": attn.tp_size * attn.pp_size * attn.cp_size > 1,
        "actor hybrid (attn | ffn)": "(attn:" in cfg.actor.backend,
        "actor context parallel": attn.cp_size > 1,
        "actor expert parallel": attn.ep_size > 1,
        "route mode": cfg.econfig.arena_llm_route_mode,
        "agent": (agent.mode, agent.export_style),
        "parsers": (agent.tool_call_parser, agent.reasoning_parser),
        "scheduling strategy": (strategy.type, strategy.target, strategy.fork),
        "weight update": cfg.actor.weight_update_mode,
        "multi-stream": bool(cfg.econfig.arena_streams or cfg.econfig.arena_streams_file),
        "budget rule": cfg.gconfig.max_tokens == cfg.sglang.context_length - 1,
        "group normalisation": (
            cfg.gconfig.reward_normalization,
            cfg.gconfig.drop_incomplete_group,
        ),
    }


# What a mini twin may not keep, and why (each also said in the twin's header comment).
MINI_DIFFERENCES: dict[str, dict[str, tuple]] = {}


@pytest.mark.parametrize(("parent", "twin"), MINI_TWINS)
def test_each_profile_has_a_mini_twin_with_its_topology(profile_env, monkeypatch, parent, twin):
    from areal.api.config.support import unsupported

    monkeypatch.delenv("ACTOR_BACKEND", raising=False)
    text = (SWE_DIR / twin).read_text()
    assert f"  - {parent.removesuffix('.yaml')}\n" in text  # composes on the real profile
    big, small = _topology(load(parent)), _topology(load(twin))
    allowed = MINI_DIFFERENCES.get(twin, {})
    for key, value in big.items():
        if key in allowed:
            assert (value, small[key]) == allowed[key], key
        else:
            assert small[key] == value, f"{twin} changes {key}: {value!r} -> {small[key]!r}"
    assert unsupported(load(twin)) == []  # the twin runs at its shape here
