"""The PPO/GRPO experiment config: the root of every training YAML."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from areal.api.config.experiment import BaseExperimentConfig
from areal.api.config.fields import FieldError, cfg_field
from areal.api.config.inference import (
    GenerationHyperparameters,
    InferenceEngineConfig,
    SGLangConfig,
    vLLMConfig,
)
from areal.api.config.train import PPOActorConfig, PPOCriticConfig, TeacherConfig

__all__ = ["GRPOConfig", "PPOConfig"]


@dataclass
class PPOConfig(BaseExperimentConfig):
    """A PPO experiment: sampling, rollout, actor (and optional ref/critic/teacher)."""

    gconfig: GenerationHyperparameters = cfg_field(
        factory=GenerationHyperparameters, help="Rollout sampling."
    )
    eval_gconfig: GenerationHyperparameters | None = cfg_field(
        None, help="Evaluation sampling; null copies gconfig."
    )
    rollout: InferenceEngineConfig = cfg_field(
        factory=InferenceEngineConfig, help="Inference servers and rollout control."
    )
    actor: PPOActorConfig = cfg_field(factory=PPOActorConfig, help="The policy being trained.")
    ref: PPOActorConfig | None = cfg_field(
        None, help="Reference model; built only when actor.kl_ctl > 0."
    )
    critic: PPOCriticConfig | None = cfg_field(None, help="Value model (unused by GRPO).")
    teacher: TeacherConfig | None = cfg_field(None, help="Teacher model (not supported).")
    sglang: SGLangConfig = cfg_field(factory=SGLangConfig, help="SGLang server flags.")
    vllm: vLLMConfig = cfg_field(factory=vLLMConfig, help="Accepted; vLLM is not supported.")
    dynamic_bs: bool = cfg_field(False, help="Dynamic batch size (not used by the PPO loop).")

    def validate(self) -> None:
        super().validate()
        if self.eval_gconfig is None:
            self.eval_gconfig = copy.deepcopy(self.gconfig)
        if (
            self.rollout.deterministic_sampling
            and self.gconfig.n_samples > 1
            and self.gconfig.seed is not None
        ):
            raise FieldError(
                "gconfig.seed",
                "a fixed seed with n_samples > 1 and rollout.deterministic_sampling would "
                "make every sample of a group identical; set gconfig.seed: null",
            )
        if self.gconfig.reward_normalization and self.actor.reward_norm is not None:
            raise FieldError(
                "actor.reward_norm",
                "gconfig.reward_normalization already normalizes rewards per group; "
                "set actor.reward_norm: null or gconfig.reward_normalization: false",
            )
        if self.rollout.use_lora and not self.rollout.lora_name:
            self.rollout.lora_name = self.gconfig.lora_name


@dataclass
class GRPOConfig(PPOConfig):
    """GRPO is PPO with group-normalized, critic-free advantages; same fields."""
