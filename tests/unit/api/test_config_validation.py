"""Cross-field validation of the config dataclasses (docs/configs.md)."""

from __future__ import annotations

import dataclasses

import pytest

from areal.api.cli_args import (
    AgentConfig,
    BaseExperimentConfig,
    FieldError,
    GenerationHyperparameters,
    InferenceEngineConfig,
    MegatronEngineConfig,
    MicroBatchSpec,
    NormConfig,
    OptimizerConfig,
    PPOActorConfig,
    PPOConfig,
    RejectionSamplingConfig,
    SchedulingSpec,
    SchedulingStrategy,
    TrainEngineConfig,
)
from areal.api.config.fields import secret_fields
from areal.utils.secrets import SecretStr


def test_every_field_has_help():
    import typing

    seen: set[type] = set()
    missing: list[str] = []

    def visit(cls: type) -> None:
        if cls in seen:
            return
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("help"):
                missing.append(f"{cls.__name__}.{f.name}")
            for t in (hints[f.name], *typing.get_args(hints[f.name])):
                if dataclasses.is_dataclass(t) and isinstance(t, type):
                    visit(t)
                for inner in typing.get_args(t):
                    if dataclasses.is_dataclass(inner) and isinstance(inner, type):
                        visit(inner)

    from examples.swe.utils import SWEPPOConfig

    visit(SWEPPOConfig)
    assert missing == []
    assert len(seen) > 30


def test_choices_are_checked():
    with pytest.raises(FieldError, match=r"^mean_level: 'sample' is not one of"):
        NormConfig(mean_level="sample")
    assert NormConfig(mean_level=None).mean_level is None


# --- experiment level ---


def test_total_train_epochs_positive():
    with pytest.raises(FieldError, match="total_train_epochs"):
        BaseExperimentConfig(total_train_epochs=0)


def test_eval_gconfig_defaults_to_a_copy():
    cfg = PPOConfig(gconfig=GenerationHyperparameters(n_samples=3))
    assert cfg.eval_gconfig == cfg.gconfig and cfg.eval_gconfig is not cfg.gconfig


def test_deterministic_grouped_sampling_rejects_fixed_seed():
    with pytest.raises(FieldError, match=r"^gconfig\.seed"):
        PPOConfig(
            gconfig=GenerationHyperparameters(n_samples=4, seed=7),
            rollout=InferenceEngineConfig(deterministic_sampling=True),
        )
    PPOConfig(
        gconfig=GenerationHyperparameters(n_samples=1, seed=7),
        rollout=InferenceEngineConfig(deterministic_sampling=True),
    )


def test_reward_normalization_excludes_actor_reward_norm():
    with pytest.raises(FieldError, match=r"^actor\.reward_norm"):
        PPOConfig(
            gconfig=GenerationHyperparameters(reward_normalization=True),
            actor=PPOActorConfig(reward_norm=NormConfig()),
        )


def test_lora_name_defaults_to_gconfig():
    cfg = PPOConfig(
        gconfig=GenerationHyperparameters(lora_name="adapter"),
        rollout=InferenceEngineConfig(use_lora=True),
    )
    assert cfg.rollout.lora_name == "adapter"


# --- train engine ---


def test_train_engine_rules():
    with pytest.raises(FieldError, match="logprobs_chunk_size"):
        TrainEngineConfig(logprobs_chunk_size=0)
    with pytest.raises(FieldError, match="scheduling_spec"):
        TrainEngineConfig(scheduling_spec=(SchedulingSpec(),) * 3)
    with pytest.raises(FieldError, match="attn_impl"):
        TrainEngineConfig(attn_impl="magic")
    with pytest.raises(FieldError, match="_version"):
        TrainEngineConfig(_version="v3")
    with pytest.raises(FieldError, match="memory_efficient_load"):
        TrainEngineConfig(
            init_from_scratch=True,
            fsdp=dataclasses.replace(TrainEngineConfig().fsdp, memory_efficient_load=True),
        )
    with pytest.raises(FieldError, match="optimizer_dtype"):
        TrainEngineConfig(optimizer_dtype="float16")
    with pytest.raises(FieldError, match=r"^dtype: unknown dtype"):
        TrainEngineConfig(dtype="int8")


def test_dtype_aliases_are_canonical():
    cfg = TrainEngineConfig(dtype="bf16", grad_reduce_dtype="fp32", optimizer_dtype="bf16")
    assert (cfg.dtype, cfg.grad_reduce_dtype, cfg.optimizer_dtype) == (
        "bfloat16",
        "float32",
        "bfloat16",
    )
    assert TrainEngineConfig(dtype="fp16").dtype == "float16"


def test_train_backend_is_parsed():
    assert TrainEngineConfig(backend="fsdp:d2").backend == "fsdp:d2"
    with pytest.raises(FieldError, match=r"^backend: .*inference backend"):
        TrainEngineConfig(backend="hf:d1")
    with pytest.raises(FieldError, match=r"^backend: .*pipeline"):
        TrainEngineConfig(backend="fsdp:d2p2")


def test_micro_batch_spec():
    with pytest.raises(FieldError, match="n_mbs"):
        MicroBatchSpec(n_mbs=0)
    with pytest.raises(FieldError, match="packing_algorithm"):
        MicroBatchSpec(packing_algorithm="greedy")


def test_optimizer_warmup(areal_logs):
    assert OptimizerConfig(warmup_steps=5).num_warmup_steps(1000) == 5
    assert "warmup_steps=5 wins" in areal_logs.text
    assert OptimizerConfig(warmup_steps_proportion=0.1).num_warmup_steps(55) == 5  # int(5.5)
    with pytest.raises(FieldError, match="lr"):
        OptimizerConfig(lr=0)


# --- PPO actor ---


def test_gae_lambda_number_or_path():
    assert PPOActorConfig(gae_lambda=0.95).gae_lambda == 0.95
    assert PPOActorConfig(gae_lambda=1).gae_lambda == 1.0
    path = "areal.trainer.ppo.lambda_fn.vapo_length_adaptive_gae"
    assert PPOActorConfig(gae_lambda=path).gae_lambda == path
    with pytest.raises(FieldError, match="not a bool"):
        PPOActorConfig(gae_lambda=True)
    with pytest.raises(FieldError, match="gae_lambda"):
        PPOActorConfig(gae_lambda="")
    with pytest.raises(FieldError, match="gae_lambda"):
        PPOActorConfig(gae_lambda="vapo")


def test_gae_timestep_unit():
    with pytest.raises(FieldError, match="gae_timestep_unit"):
        PPOActorConfig(gae_timestep_unit="episode")


def test_group_norm_with_group_size_one_only_warns(areal_logs):
    PPOActorConfig(reward_norm=NormConfig(mean_level="group", std_level="group", group_size=1))
    assert "group_size 1" in areal_logs.text


def test_reuse_train_logp_forces_one_minibatch(areal_logs):
    cfg = PPOActorConfig(
        prox_logp_method="reuse_train_logp",
        ppo_n_minibatches=4,
        use_decoupled_loss=True,
        rejection_sampling=RejectionSamplingConfig(),
    )
    assert cfg.ppo_n_minibatches == 1
    assert "forces ppo_n_minibatches=1" in areal_logs.text


def test_delta_weight_update_needs_one_minibatch():
    with pytest.raises(FieldError, match="enable_delta_weight_update"):
        PPOActorConfig(enable_delta_weight_update=True, ppo_n_minibatches=2)


def test_decoupled_loss_and_rejection_sampling_warnings(areal_logs):
    PPOActorConfig(rejection_sampling=RejectionSamplingConfig())
    assert "use_decoupled_loss is false" in areal_logs.text
    areal_logs.clear()
    PPOActorConfig(use_decoupled_loss=True)
    assert "without rejection_sampling" in areal_logs.text


def test_sapo_rules():
    with pytest.raises(FieldError, match="positive temperatures"):
        PPOActorConfig(use_sapo_loss=True, sapo_tau_neg=0.0)
    with pytest.raises(FieldError, match="decoupled"):
        PPOActorConfig(use_sapo_loss=True, use_decoupled_loss=True)


def test_cispo_rules():
    with pytest.raises(FieldError, match="eps_clip_higher"):
        PPOActorConfig(use_cispo_loss=True)
    with pytest.raises(FieldError, match="SAPO"):
        PPOActorConfig(use_cispo_loss=True, use_sapo_loss=True, eps_clip_higher=0.28)
    with pytest.raises(FieldError, match="importance_sampling_level"):
        PPOActorConfig(
            use_cispo_loss=True, eps_clip_higher=0.28, importance_sampling_level="sequence"
        )
    assert PPOActorConfig(use_cispo_loss=True, eps_clip_higher=0.28).use_cispo_loss


def test_should_compute_prox_logp():
    assert PPOActorConfig(
        use_decoupled_loss=True, prox_logp_method="recompute"
    ).should_compute_prox_logp()
    assert not PPOActorConfig(
        use_decoupled_loss=True, prox_logp_method="loglinear"
    ).should_compute_prox_logp()
    assert not PPOActorConfig(
        use_decoupled_loss=True, prox_logp_method="reuse_train_logp", ppo_n_minibatches=1
    ).should_compute_prox_logp()
    assert PPOActorConfig(recompute_logprob=True).should_compute_prox_logp()
    assert not PPOActorConfig().should_compute_prox_logp()


# --- normalization and rejection sampling ---


def test_norm_group_size():
    with pytest.raises(FieldError, match="group_size"):
        NormConfig(mean_level="group", group_size=0)
    NormConfig(mean_level="batch", std_level=None, group_size=0)


def test_rejection_sampling_rules(areal_logs):
    with pytest.raises(FieldError, match=r"^action: clamp is only allowed"):
        RejectionSamplingConfig(action="clamp", metric="kl_k1", upper=1.0)
    with pytest.raises(FieldError, match=r"^upper: must be > 1.0"):
        RejectionSamplingConfig(metric="ratio", upper=1.0)
    with pytest.raises(FieldError, match=r"^lower: must be > 0"):
        RejectionSamplingConfig(metric="ratio", lower=0.0)
    with pytest.raises(FieldError, match=r"^lower: must be <= upper"):
        RejectionSamplingConfig(metric="ratio", upper=2.0, lower=3.0)
    with pytest.raises(FieldError, match="kl_k2"):
        RejectionSamplingConfig(metric="kl_k2", upper=0.0)
    with pytest.raises(FieldError, match="metric"):
        RejectionSamplingConfig(metric="binary_kl")
    # kl_k1 may use any bounds, including negative ones
    assert RejectionSamplingConfig(metric="kl_k1", upper=0.5, lower=-0.5)
    RejectionSamplingConfig(level="token", agg="max")
    assert "agg is ignored" in areal_logs.text
    rs = RejectionSamplingConfig(action="clamp")
    assert rs.lower is None  # the loss treats a null clamp bound as 0


def test_megatron_chunked_logits():
    with pytest.raises(FieldError, match="lm_head_loss_chunk_size"):
        MegatronEngineConfig(enable_chunked_logits=True)
    assert MegatronEngineConfig(enable_chunked_logits=True, lm_head_loss_chunk_size=4096)


# --- rollout side ---


def test_inference_engine_rules(areal_logs):
    with pytest.raises(FieldError, match="scheduling_spec"):
        InferenceEngineConfig(scheduling_spec=())
    with pytest.raises(FieldError, match="_version"):
        InferenceEngineConfig(_version="v9")
    # an unset admin key is generated per run (areal.proxy.keys.ensure_run_admin_keys)
    assert InferenceEngineConfig(admin_api_key="  ").admin_api_key == ""
    with pytest.raises(FieldError, match=r"admin_api_key: .*printed form"):
        InferenceEngineConfig(admin_api_key="<redacted>")
    with pytest.raises(FieldError, match="request_retries"):
        InferenceEngineConfig(request_retries=0)
    with pytest.raises(FieldError, match=r"^backend: .*training backend"):
        InferenceEngineConfig(backend="fsdp:d8")
    with pytest.raises(FieldError, match=r"^backend: vllm is not supported"):
        InferenceEngineConfig(backend="vllm:d1")
    InferenceEngineConfig(deterministic_sampling=True, max_head_offpolicyness=2)
    assert "not reproducible" in areal_logs.text


def test_agent_config_rules():
    with pytest.raises(FieldError, match="agent_cls_path"):
        AgentConfig(mode="online")
    assert AgentConfig(mode="inline").agent_cls_path == ""
    with pytest.raises(FieldError, match="exactly one"):
        AgentConfig(scheduling_spec=(SchedulingSpec(), SchedulingSpec()))
    assert AgentConfig().admin_api_key == ""  # unset: the trainer generates one per run
    with pytest.raises(FieldError, match=r"admin_api_key: .*printed form"):
        AgentConfig(admin_api_key="<redacted>")
    with pytest.raises(FieldError, match="set_reward_finish_timeout"):
        AgentConfig(set_reward_finish_timeout=-1)


def test_agent_parser_names_are_checked():
    # native, SGLang 0.5.23's (SGLang reads reasoning names in lower case) and none
    AgentConfig(tool_call_parser="ling3", reasoning_parser="ling3")
    AgentConfig(tool_call_parser="glm45", reasoning_parser="Kimi")
    AgentConfig(tool_call_parser="none", reasoning_parser="")
    with pytest.raises(FieldError) as error:
        AgentConfig(tool_call_parser="ling-3")
    message = str(error.value)
    assert message.startswith("tool_call_parser: 'ling-3' is not a tool call parser")
    assert "native: qwen, qwen25, hermes, qwen3, qwen3_coder, ling3;" in message
    assert "through SGLang 0.5.23" in message and "glm45, glm47" in message
    with pytest.raises(FieldError, match=r"^reasoning_parser: 'qwen-3' is not a reasoning"):
        AgentConfig(reasoning_parser="qwen-3")
    with pytest.raises(FieldError, match=r"^tool_call_parser: 'Qwen25'"):  # exact case
        AgentConfig(tool_call_parser="Qwen25")


def test_generation_rules():
    with pytest.raises(FieldError, match="n_samples"):
        GenerationHyperparameters(n_samples=0)
    with pytest.raises(FieldError, match="top_p"):
        GenerationHyperparameters(top_p=0.0)


def test_to_openai_args_dict():
    g = GenerationHyperparameters(
        n_samples=2,
        max_new_tokens=64,
        temperature=0.7,
        top_p=0.9,
        reward_normalization=True,
        drop_incomplete_group=True,
    )
    assert g.to_openai_args_dict() == {
        "n": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_completion_tokens": 64,
    }
    assert g.to_openai_args_dict("responses")["max_output_tokens"] == 64
    assert g.to_openai_args_dict("openai-agents")["max_tokens"] == 64
    assert g.new(greedy=True).to_openai_args_dict()["temperature"] == 0.0
    with pytest.raises(ValueError, match="api_format"):
        g.to_openai_args_dict("grpc")


def test_scheduling_strategy_colocation_needs_target():
    with pytest.raises(FieldError, match="target"):
        SchedulingStrategy(type="colocation")


# --- secrets are a type ---


def test_secret_fields_are_secret_strings():
    agent = AgentConfig(admin_api_key="hunter2-admin")
    assert isinstance(agent.admin_api_key, SecretStr)
    assert agent.admin_api_key == "hunter2-admin"
    assert "hunter2" not in repr(agent) and "hunter2" not in f"{agent.admin_api_key}"
    assert agent.admin_api_key.reveal() == "hunter2-admin"


def test_secret_field_inventory():
    from examples.swe.utils import SWEPPOConfig

    paths = secret_fields(SWEPPOConfig())
    assert set(paths) == {
        "rollout.agent.admin_api_key",
        "rollout.admin_api_key",
        "rollout.provider_api_key",
        "stats_logger.wandb.wandb_api_key",
        "stats_logger.swanlab.api_key",
        "econfig.arena_streams_yaml_b64",
    }
