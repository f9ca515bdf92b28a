"""The PPO/GRPO experiment config: the root of every training YAML."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from areal.api.config.experiment import BaseExperimentConfig
from areal.api.config.fields import MISSING, FieldError, cfg_field
from areal.api.config.inference import (
    GenerationHyperparameters,
    InferenceEngineConfig,
    SGLangConfig,
    vLLMConfig,
)
from areal.api.config.scheduling import SchedulingStrategy
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
        None,
        help="Reference model of the KL penalty, built only when actor.kl_ctl > 0; null "
        "then means a frozen copy of the actor forked next to the actor's workers.",
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

    def ref_config(self) -> PPOActorConfig | None:
        """The reference model's engine config; None when ``actor.kl_ctl`` is 0.

        It is ``ref`` when set, else a copy of the actor colocated with it (a forked process
        beside each actor worker, on its devices). Unset ``path``, ``backend`` and names are
        the actor's. The ref never trains (no optimizer) and scores tokens at the actor's
        temperature, so its log-probs compare with the sampling policy's.
        """
        actor = self.actor
        if actor.kl_ctl == 0:
            return None
        # a copy with fields set, not dataclasses.replace: validation (and its warnings)
        # already ran on the node copied
        ref = copy.deepcopy(self.ref if self.ref is not None else actor)
        if self.ref is None:
            ref.scheduling_strategy = SchedulingStrategy(
                type="colocation", target="actor", fork=True
            )
        for name in ("path", "backend", "experiment_name", "trial_name"):
            if getattr(ref, name) in ("", MISSING):
                setattr(ref, name, getattr(actor, name))
        ref.optimizer = None
        ref.temperature = actor.temperature
        ref.weight_sync_check = False
        return ref


@dataclass
class GRPOConfig(PPOConfig):
    """GRPO is PPO with group-normalized, critic-free advantages; same fields."""
