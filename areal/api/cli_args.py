"""Experiment configs and how they are loaded (the import path YAML users rely on).

The dataclasses live in ``areal.api.config.*`` by topic; this module gathers them with
the loader functions so that ``from areal.api.cli_args import PPOConfig,
load_expr_config`` works as in the reference.
"""

from __future__ import annotations

from areal.api.config.experiment import (
    BaseExperimentConfig,
    ClusterSpecConfig,
    EvaluatorConfig,
    MemoryProfilerConfig,
    NameResolveConfig,
    PerfTracerConfig,
    RecoverConfig,
    SaverConfig,
    SchedulerConfig,
    SessionTracerConfig,
    StatsLoggerConfig,
    SwanlabConfig,
    TensorBoardConfig,
    TrackioConfig,
    TrainDatasetConfig,
    ValidDatasetConfig,
    WandBConfig,
)
from areal.api.config.fields import MISSING, ConfigError, ConfigNode, FieldError
from areal.api.config.inference import (
    AgentConfig,
    GenerationHyperparameters,
    InferenceEngineConfig,
    SGLangConfig,
    vLLMConfig,
)
from areal.api.config.loader import (
    check_known_keys,
    conf_as_dict,
    instantiate_config,
    load_expr_config,
    parse_cli_args,
    save_config,
    to_structured_cfg,
)
from areal.api.config.ppo import GRPOConfig, PPOConfig
from areal.api.config.scheduling import SchedulingSpec, SchedulingStrategy
from areal.api.config.train import (
    FSDPEngineConfig,
    FSDPWrapPolicy,
    MegatronDDPConfig,
    MegatronEngineConfig,
    MicroBatchSpec,
    NormConfig,
    OptimizerConfig,
    PPOActorConfig,
    PPOCriticConfig,
    RejectionSamplingConfig,
    TeacherConfig,
    TrainEngineConfig,
)
from areal.utils.command import get_py_cmd

__all__ = [
    "MISSING",
    "AgentConfig",
    "BaseExperimentConfig",
    "ClusterSpecConfig",
    "ConfigError",
    "ConfigNode",
    "EvaluatorConfig",
    "FSDPEngineConfig",
    "FSDPWrapPolicy",
    "FieldError",
    "GRPOConfig",
    "GenerationHyperparameters",
    "InferenceEngineConfig",
    "MegatronDDPConfig",
    "MegatronEngineConfig",
    "MemoryProfilerConfig",
    "MicroBatchSpec",
    "NameResolveConfig",
    "NormConfig",
    "OptimizerConfig",
    "PPOActorConfig",
    "PPOConfig",
    "PPOCriticConfig",
    "PerfTracerConfig",
    "RecoverConfig",
    "RejectionSamplingConfig",
    "SGLangConfig",
    "SaverConfig",
    "SchedulerConfig",
    "SchedulingSpec",
    "SchedulingStrategy",
    "SessionTracerConfig",
    "StatsLoggerConfig",
    "SwanlabConfig",
    "TeacherConfig",
    "TensorBoardConfig",
    "TrackioConfig",
    "TrainDatasetConfig",
    "TrainEngineConfig",
    "ValidDatasetConfig",
    "WandBConfig",
    "check_known_keys",
    "conf_as_dict",
    "get_py_cmd",
    "instantiate_config",
    "load_expr_config",
    "parse_cli_args",
    "save_config",
    "to_structured_cfg",
    "vLLMConfig",
]
