"""Experiment-level configs: cluster, scheduler, datasets, saving, logging."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal.api.config.fields import MISSING, ConfigNode, FieldError, cfg_field
from areal.api.config.scheduling import SchedulingSpec
from areal.utils.paths import path_name_problem

__all__ = [
    "BaseExperimentConfig",
    "ClusterSpecConfig",
    "EvaluatorConfig",
    "MemoryProfilerConfig",
    "NameResolveConfig",
    "PerfTracerConfig",
    "RecoverConfig",
    "SaverConfig",
    "SchedulerConfig",
    "SessionTracerConfig",
    "StatsLoggerConfig",
    "SwanlabConfig",
    "TensorBoardConfig",
    "TrackioConfig",
    "TrainDatasetConfig",
    "ValidDatasetConfig",
    "WandBConfig",
    "check_path_names",
]


@dataclass
class NameResolveConfig(ConfigNode):
    """Key/value discovery of worker addresses."""

    type: str = cfg_field(
        "nfs",
        help="Backend: a shared directory (nfs), etcd3 or ray.",
        choices=("nfs", "etcd3", "ray"),
    )
    nfs_record_root: str = cfg_field(
        "/tmp/areal/name_resolve", help="Record directory; must be on storage all nodes share."
    )
    etcd3_addr: str = cfg_field("localhost:2379", help="etcd3 host:port.")
    ray_actor_name: str = cfg_field("ray_kv_store", help="Ray KV actor name.")


@dataclass
class ClusterSpecConfig(ConfigNode):
    """Where files go and what the cluster looks like."""

    name_resolve: NameResolveConfig = cfg_field(factory=NameResolveConfig, help="Worker discovery.")
    cluster_name: str = cfg_field("local", help="Cluster name (informational).")
    fileroot: str = cfg_field("/tmp/areal/", help="Root of logs, checkpoints and dumps (shared).")
    n_nodes: int = cfg_field(32, help="Nodes available to the experiment.")
    n_gpus_per_node: int = cfg_field(8, help="GPUs per node; Slurm jobs take whole nodes.")

    def validate(self) -> None:
        if self.n_nodes < 1:
            raise FieldError("n_nodes", "must be >= 1")
        if self.n_gpus_per_node < 0:
            raise FieldError("n_gpus_per_node", "must be >= 0")


@dataclass
class SchedulerConfig(ConfigNode):
    """Which scheduler starts workers. The other fields are legacy and unused."""

    type: str | None = cfg_field(
        None,
        help="'local' (subprocesses here), 'slurm' (sbatch + container) or 'ray' (actors of "
        "a running Ray cluster).",
        choices=(None, "local", "slurm", "ray"),
    )
    ray_address: str | None = cfg_field(
        None,
        help="Ray only: the running cluster's address (GCS host:port, 'auto' or "
        "ray://host:10001); unset: $RAY_ADDRESS. A cluster is never started.",
    )
    endpoint: str = cfg_field("http://localhost:8081", help="Legacy; unused.")
    deploy_mode: str = cfg_field("separation", help="Legacy; unused.")
    functioncall_service_domain: str = cfg_field("http://localhost:8080", help="Legacy; unused.")
    reward_functioncall_config: dict[str, Any] = cfg_field(factory=dict, help="Legacy; unused.")
    reward_model_path: str = cfg_field("", help="Legacy; unused.")
    reward_model_service_url: str = cfg_field(
        "http://localhost:30000/classify", help="Legacy; unused."
    )


def check_path_names(node: object, *names: str) -> None:
    """Raise :class:`FieldError` for the first of ``names`` whose value cannot be one path part.

    Experiment and trial names become directories (logs, checkpoints, name-resolve
    records), so ``../x`` or ``a/b`` would write outside ``fileroot``. Unset values
    (``MISSING``, ``None``) are left to the required-field checks.
    """
    for name in names:
        value = getattr(node, name)
        if value is None or value == MISSING:
            continue
        problem = path_name_problem(value)
        if problem is not None:
            raise FieldError(name, f"{problem}; it is used as a directory name")


def _dataset_service_spec() -> SchedulingSpec:
    return SchedulingSpec(cpu=1, gpu=0, mem=10)


@dataclass
class _DatasetConfig(ConfigNode):
    path: str = cfg_field(MISSING, help="Dataset path or name ('arena' for Arena Streams).")
    type: str = cfg_field(MISSING, help="Dataset kind, e.g. 'rl'.")
    batch_size: int = cfg_field(1, help="Prompts per step.")
    pin_memory: bool = cfg_field(False, help="Pin host memory in the dataloader.")
    num_workers: int = cfg_field(0, help="Dataloader worker processes.")
    num_dataset_workers: int = cfg_field(1, help="Remote dataset service workers.")
    max_length: int | None = cfg_field(None, help="Max prompt length in tokens.")
    dataset_kwargs: dict[str, Any] = cfg_field(factory=dict, help="Extra loader arguments.")
    scheduling_spec: SchedulingSpec = cfg_field(
        factory=_dataset_service_spec, help="Resources of a remote dataset service."
    )
    setup_timeout: float = cfg_field(120.0, help="Seconds to wait for a dataset service.")

    def validate(self) -> None:
        if self.batch_size < 1:
            raise FieldError("batch_size", f"must be >= 1 (got {self.batch_size})")
        if self.num_workers < 0:
            raise FieldError("num_workers", "must be >= 0")


@dataclass
class TrainDatasetConfig(_DatasetConfig):
    """The training prompts."""

    split: str = cfg_field("train", help="Dataset split.")
    shuffle: bool = cfg_field(True, help="Shuffle every epoch.")
    drop_last: bool = cfg_field(True, help="Drop the last incomplete batch.")


@dataclass
class ValidDatasetConfig(_DatasetConfig):
    """The evaluation prompts."""

    split: str = cfg_field("test", help="Dataset split.")
    shuffle: bool = cfg_field(False, help="Shuffle every epoch.")
    drop_last: bool = cfg_field(False, help="Drop the last incomplete batch.")


@dataclass
class _TimedConfig(ConfigNode):
    experiment_name: str = cfg_field(MISSING, help="Experiment name.")
    trial_name: str = cfg_field(MISSING, help="Trial name.")
    fileroot: str = cfg_field(MISSING, help="Root directory for outputs.")
    freq_epochs: int | None = cfg_field(None, help="Fire every N epochs (null: never).")
    freq_steps: int | None = cfg_field(None, help="Fire every N steps (null: never).")
    freq_secs: int | None = cfg_field(None, help="Fire every N seconds (null: never).")

    def validate(self) -> None:
        check_path_names(self, "experiment_name", "trial_name")
        for name in ("freq_epochs", "freq_steps", "freq_secs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise FieldError(name, f"must be >= 1 or null (got {value})")


@dataclass
class SaverConfig(_TimedConfig):
    """HF-format checkpoints for use outside training."""

    mode: str = cfg_field(
        "auto", help="Save synchronously or not.", choices=("auto", "sync", "async")
    )


@dataclass
class EvaluatorConfig(_TimedConfig):
    """Periodic evaluation on the valid dataset."""

    eval_before_train: bool = cfg_field(False, help="Evaluate once before the first step.")


@dataclass
class RecoverConfig(_TimedConfig):
    """Recover checkpoints, to resume a crashed or killed run."""

    mode: str = cfg_field(
        "disabled",
        help="disabled/off: never; on: always resume; auto: resume if a checkpoint exists.",
        choices=("disabled", "off", "on", "auto"),
    )
    retries: int = cfg_field(3, help="Launcher restarts (SPMD launchers only).")
    no_save_optim: bool = cfg_field(False, help="Leave optimizer state out of checkpoints.")
    no_load_optim: bool = cfg_field(False, help="Do not restore optimizer state.")


@dataclass
class WandBConfig(ConfigNode):
    """Weights & Biases logging."""

    mode: str = cfg_field(
        "disabled", help="W&B mode.", choices=("online", "offline", "disabled", "shared")
    )
    wandb_base_url: str = cfg_field("", help="W&B server URL (exported as WANDB_BASE_URL).")
    wandb_api_key: str = cfg_field("", help="W&B key (exported as WANDB_API_KEY).", secret=True)
    entity: str | None = cfg_field(None, help="W&B entity.")
    project: str | None = cfg_field(None, help="W&B project (default: experiment_name).")
    name: str | None = cfg_field(None, help="Run name (default: trial_name).")
    job_type: str | None = cfg_field(None, help="Job type.")
    group: str | None = cfg_field(None, help="Run group (default: '<exp>_<trial>').")
    notes: str | None = cfg_field(None, help="Run notes.")
    tags: list[str] | None = cfg_field(None, help="Run tags.")
    config: dict[str, Any] | None = cfg_field(None, help="Extra run config.")
    id_suffix: str | None = cfg_field("train", help="Run id suffix; 'timestamp' uses the time.")


@dataclass
class SwanlabConfig(ConfigNode):
    """SwanLab logging."""

    project: str | None = cfg_field(None, help="Project.")
    name: str | None = cfg_field(None, help="Run name.")
    config: dict[str, Any] | None = cfg_field(None, help="Extra run config.")
    logdir: str | None = cfg_field(None, help="Local log directory.")
    mode: str | None = cfg_field(
        "disabled", help="SwanLab mode.", choices=("cloud", "local", "disabled", "offline")
    )
    api_key: str | None = cfg_field(None, help="Key (falls back to SWANLAB_API_KEY).", secret=True)


@dataclass
class TensorBoardConfig(ConfigNode):
    """TensorBoard logging."""

    path: str | None = cfg_field(None, help="Event directory; null disables TensorBoard.")


@dataclass
class TrackioConfig(ConfigNode):
    """Trackio logging."""

    mode: str = cfg_field("disabled", help="Trackio mode.", choices=("disabled", "online", "local"))
    project: str | None = cfg_field(None, help="Project.")
    name: str | None = cfg_field(None, help="Run name.")
    space_id: str | None = cfg_field(None, help="Hugging Face space id.")


@dataclass
class StatsLoggerConfig(ConfigNode):
    """Where per-step statistics go."""

    experiment_name: str = cfg_field(MISSING, help="Experiment name.")
    trial_name: str = cfg_field(MISSING, help="Trial name.")
    fileroot: str = cfg_field(MISSING, help="Root directory; logs go under <fileroot>/logs.")
    wandb: WandBConfig = cfg_field(factory=WandBConfig, help="Weights & Biases.")
    swanlab: SwanlabConfig = cfg_field(factory=SwanlabConfig, help="SwanLab.")
    tensorboard: TensorBoardConfig = cfg_field(factory=TensorBoardConfig, help="TensorBoard.")
    trackio: TrackioConfig = cfg_field(factory=TrackioConfig, help="Trackio.")

    def validate(self) -> None:
        check_path_names(self, "experiment_name", "trial_name")


@dataclass
class SessionTracerConfig(ConfigNode):
    """Per-session proxy tracing."""

    enabled: bool = cfg_field(False, help="Record session traces.")
    flush_threshold: int = cfg_field(256, help="Records buffered before a flush.")


@dataclass
class PerfTracerConfig(ConfigNode):
    """Performance tracing (Chrome trace format)."""

    experiment_name: str = cfg_field(MISSING, help="Experiment name.")
    trial_name: str = cfg_field(MISSING, help="Trial name.")
    fileroot: str = cfg_field(MISSING, help="Root directory for traces.")
    enabled: bool = cfg_field(False, help="Record traces.")
    save_interval: int = cfg_field(1, help="Steps between trace saves.")
    profile_steps: list[int] | None = cfg_field(None, help="Steps to profile with torch.")
    session_tracer: SessionTracerConfig | None = cfg_field(None, help="Session tracing.")

    def validate(self) -> None:
        check_path_names(self, "experiment_name", "trial_name")


@dataclass
class MemoryProfilerConfig(ConfigNode):
    """CUDA memory snapshots."""

    profile_steps: list[int] = cfg_field(factory=lambda: [0, 1], help="Steps to snapshot.")
    max_entries: int = cfg_field(100000, help="Allocation records kept.")


@dataclass
class BaseExperimentConfig(ConfigNode):
    """Fields every experiment has."""

    experiment_name: str = cfg_field(MISSING, help="Experiment name (paths, job names, W&B).")
    trial_name: str = cfg_field(MISSING, help="Trial name (paths, job names, W&B).")
    cluster: ClusterSpecConfig = cfg_field(factory=ClusterSpecConfig, help="Cluster and files.")
    allocation_mode: str = cfg_field("", help="Deprecated; each engine has its own backend.")
    seed: int = cfg_field(1, help="Base seed; each process adds a hash of its role and rank.")
    enable_offload: bool = cfg_field(False, help="Required for colocation with offload.")
    total_train_epochs: int = cfg_field(1, help="Passes over the training data (> 0).")
    total_train_steps: int | None = cfg_field(None, help="Hard stop after this many steps.")
    total_train_n_seqs: int | None = cfg_field(None, help="Unused by the PPO loop.")
    tokenizer_path: str = cfg_field("", help="Tokenizer loaded by the trainer.")
    train_dataset: TrainDatasetConfig = cfg_field(
        factory=TrainDatasetConfig, help="Training prompts."
    )
    valid_dataset: ValidDatasetConfig | None = cfg_field(None, help="Evaluation prompts.")
    saver: SaverConfig = cfg_field(factory=SaverConfig, help="HF checkpoints.")
    evaluator: EvaluatorConfig = cfg_field(factory=EvaluatorConfig, help="Evaluation schedule.")
    recover: RecoverConfig = cfg_field(factory=RecoverConfig, help="Recover checkpoints.")
    stats_logger: StatsLoggerConfig = cfg_field(
        factory=StatsLoggerConfig, help="Statistics backends."
    )
    perf_tracer: PerfTracerConfig | None = cfg_field(None, help="Performance tracing.")
    memory_profiler: MemoryProfilerConfig | None = cfg_field(None, help="Memory snapshots.")
    scheduler: SchedulerConfig = cfg_field(factory=SchedulerConfig, help="Worker scheduler.")
    post_exit_hook: str = cfg_field("", help="SPMD launchers only.")

    def validate(self) -> None:
        check_path_names(self, "experiment_name", "trial_name")
        if self.total_train_epochs <= 0:
            raise FieldError("total_train_epochs", f"must be > 0 (got {self.total_train_epochs})")
        if self.total_train_steps is not None and self.total_train_steps < 1:
            raise FieldError("total_train_steps", "must be >= 1 or null")
