"""Training-engine configs: micro-batching, optimizer, FSDP, Megatron, the PPO actor."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from areal.api.alloc_mode import ModelAllocation
from areal.api.config.fields import MISSING, ConfigNode, FieldError, cfg_field
from areal.api.config.scheduling import RPC_SERVER_CMD, SchedulingSpec, SchedulingStrategy

__all__ = [
    "FSDPEngineConfig",
    "FSDPWrapPolicy",
    "MegatronDDPConfig",
    "MegatronEngineConfig",
    "MicroBatchSpec",
    "NormConfig",
    "OptimizerConfig",
    "PPOActorConfig",
    "PPOCriticConfig",
    "RejectionSamplingConfig",
    "TeacherConfig",
    "TrainEngineConfig",
]

DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
}
ATTN_IMPLS = ("flash_attention_2", "flash_attention_3", "sdpa", "eager", "flex_attention")


@dataclass
class MicroBatchSpec(ConfigNode):
    """How a batch is split into micro-batches for forward/backward."""

    n_mbs: int = cfg_field(1, help="Number (a minimum when max_tokens_per_mb is set) of mbs.")
    granularity: int = cfg_field(1, help="Adjacent sequences kept together in groups of this.")
    max_tokens_per_mb: int | None = cfg_field(
        None, help="Token budget per micro-batch; None means unbounded."
    )
    n_mbs_divisor: int = cfg_field(1, help="Round the final micro-batch count to a multiple.")
    packing_algorithm: str = cfg_field(
        "ffd",
        help="Sequence packing: first-fit-decreasing or Karmarkar-Karp.",
        choices=("ffd", "kk"),
    )

    def validate(self) -> None:
        for name in ("n_mbs", "granularity", "n_mbs_divisor"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be >= 1 (got {getattr(self, name)})")
        if self.max_tokens_per_mb is not None and self.max_tokens_per_mb < 1:
            raise FieldError("max_tokens_per_mb", "must be a positive token count or null")


@dataclass
class OptimizerConfig(ConfigNode):
    """Optimizer and learning-rate schedule."""

    type: str = cfg_field(
        "adam", help="adam (AdamW), adam_bf16 or sgd.", choices=("adam", "adam_bf16", "sgd")
    )
    lr: float = cfg_field(1e-3, help="Peak learning rate.")
    weight_decay: float = cfg_field(0.01, help="Decoupled weight decay.")
    beta1: float = cfg_field(0.9, help="Adam beta1.")
    beta2: float = cfg_field(0.999, help="Adam beta2.")
    eps: float = cfg_field(1e-8, help="Adam epsilon.")
    min_lr_ratio: float = cfg_field(0.0, help="Final lr as a fraction of lr (linear/cosine).")
    lr_scheduler_type: str = cfg_field(
        "constant", help="LR schedule after warmup.", choices=("linear", "cosine", "constant")
    )
    warmup_steps_proportion: float = cfg_field(
        0.001, help="Warmup length as a fraction of total train steps."
    )
    warmup_steps: int | None = cfg_field(
        None, help="Warmup length in steps; wins over warmup_steps_proportion."
    )
    initial_loss_scale: float = cfg_field(2.0**32, help="fp16 only: initial loss scale.")
    min_loss_scale: float = cfg_field(1.0, help="fp16 only: minimum loss scale.")
    loss_scale_window: float = cfg_field(5, help="fp16 only: steps between scale increases.")
    hysteresis: int = cfg_field(2, help="fp16 only: overflow tolerance before scaling down.")
    gradient_clipping: float = cfg_field(1.0, help="Global grad-norm clip; 0 disables.")

    def validate(self) -> None:
        if not self.lr > 0:
            raise FieldError("lr", f"must be > 0 (got {self.lr})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise FieldError("min_lr_ratio", "must be within [0, 1]")
        if not 0.0 <= self.warmup_steps_proportion <= 1.0:
            raise FieldError("warmup_steps_proportion", "must be within [0, 1]")
        if self.warmup_steps is not None:
            if self.warmup_steps < 0:
                raise FieldError("warmup_steps", "must be >= 0")
            if self.warmup_steps_proportion:
                self.warn(
                    "optimizer: both warmup_steps and warmup_steps_proportion are set; "
                    f"warmup_steps={self.warmup_steps} wins"
                )

    def num_warmup_steps(self, total_train_steps: int) -> int:
        """Warmup steps: ``warmup_steps`` or ``int(proportion x total_train_steps)``."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return int(self.warmup_steps_proportion * total_train_steps)


@dataclass
class NormConfig(ConfigNode):
    """Reward or advantage normalization (mean and std levels)."""

    mean_level: str | None = cfg_field(
        "batch",
        help="Subtract the mean over the batch, the group, or not (null).",
        choices=("batch", "group", None),
    )
    mean_leave1out: bool = cfg_field(False, help="Leave-one-out mean (RLOO style).")
    std_level: str | None = cfg_field(
        "batch",
        help="Divide by the std over the batch, the group, or not (null).",
        choices=("batch", "group", None),
    )
    std_unbiased: bool = cfg_field(True, help="Unbiased (N-1) std.")
    eps: float = cfg_field(1e-5, help="Added to the std before dividing.")
    group_size: int = cfg_field(1, help="Samples per group when a level is 'group'.")

    def validate(self) -> None:
        if "group" in (self.mean_level, self.std_level) and self.group_size < 1:
            raise FieldError("group_size", "must be >= 1 when a level is 'group'")


@dataclass
class RejectionSamplingConfig(ConfigNode):
    """Masks or clamps tokens whose behaviour/proximal mismatch is too large."""

    level: str = cfg_field(
        "token", help="Measure per token or per sequence.", choices=("token", "sequence")
    )
    action: str = cfg_field(
        "mask",
        help="mask: drop offending tokens; clamp: truncate the weight.",
        choices=("mask", "clamp"),
    )
    metric: str = cfg_field(
        "ratio",
        help="Importance ratio or a KL estimator.",
        choices=("ratio", "kl_k1", "kl_k2", "kl_k3"),
    )
    agg: str = cfg_field(
        "mean",
        help="Sequence-level aggregation of the token metric.",
        choices=("sum", "mean", "max"),
    )
    upper: float = cfg_field(5.0, help="Upper bound; for 'ratio' it must be > 1.")
    lower: float | None = cfg_field(
        None, help="Lower bound; for 'ratio' it must be > 0 (clamp uses 0 when null)."
    )

    def validate(self) -> None:
        if self.action == "clamp" and self.metric != "ratio":
            raise FieldError("action", "clamp is only allowed with metric 'ratio'")
        if self.metric == "ratio":
            if not self.upper > 1.0:
                raise FieldError("upper", f"must be > 1.0 for metric 'ratio' (got {self.upper})")
            if self.lower is not None and not self.lower > 0:
                raise FieldError("lower", f"must be > 0 for metric 'ratio' (got {self.lower})")
        if self.metric in ("kl_k2", "kl_k3") and not self.upper > 0:
            raise FieldError("upper", f"must be > 0 for metric {self.metric!r}")
        if self.lower is not None and self.lower > self.upper:
            raise FieldError("lower", f"must be <= upper ({self.lower} > {self.upper})")
        if self.level == "token" and self.agg != "mean":
            self.warn("rejection_sampling.agg is ignored at level 'token'")


@dataclass
class FSDPWrapPolicy(ConfigNode):
    """Which module classes become FSDP units."""

    transformer_layer_cls_to_wrap: list[str] | None = cfg_field(
        None, help="Class names to wrap; null wraps the model's decoder-layer classes."
    )


@dataclass
class FSDPEngineConfig(ConfigNode):
    """FSDP2 engine options."""

    wrap_policy: FSDPWrapPolicy | None = cfg_field(None, help="FSDP wrap policy.")
    offload_params: bool = cfg_field(False, help="Offload parameters to CPU.")
    memory_efficient_load: bool = cfg_field(
        False, help="Rank 0 loads the checkpoint then broadcasts (not with init_from_scratch)."
    )
    per_layer_optim_step: bool = cfg_field(False, help="Step the optimizer layer by layer (adam).")
    optim_step_prefetch_layers: int = cfg_field(1, help="Layers prefetched per optimizer step.")
    shard_vision_across_sp: bool = cfg_field(False, help="Shard vision towers across SP ranks.")

    def validate(self) -> None:
        if self.optim_step_prefetch_layers < 0:
            raise FieldError("optim_step_prefetch_layers", "must be >= 0")


@dataclass
class MegatronDDPConfig(ConfigNode):
    """Megatron DistributedDataParallel options (``actor.megatron.ddp``)."""

    grad_reduce_in_fp32: bool = cfg_field(True, help="Reduce gradients in fp32.")
    overlap_grad_reduce: bool = cfg_field(False, help="Overlap grad reduce with backward.")
    overlap_param_gather: bool = cfg_field(False, help="Overlap param all-gather with forward.")
    align_param_gather: bool = cfg_field(False, help="Align param gathers across PP stages.")
    use_distributed_optimizer: bool = cfg_field(True, help="Shard optimizer state (ZeRO-1).")
    check_for_nan_in_grad: bool = cfg_field(False, help="Check gradients for NaN.")
    bucket_size: int | None = cfg_field(None, help="Gradient bucket size in elements.")
    average_in_collective: bool = cfg_field(False, help="Average inside the collective.")
    fp8_param_gather: bool = cfg_field(False, help="Gather parameters in fp8.")


@dataclass
class MegatronEngineConfig(ConfigNode):
    """Megatron-core engine options (``actor.megatron``)."""

    wrap_with_ddp: bool = cfg_field(True, help="Wrap the model in Megatron DDP.")
    use_torch_fsdp2: bool = cfg_field(False, help="Use torch FSDP2 instead of Megatron DDP.")
    use_custom_fsdp: bool = cfg_field(False, help="Use Megatron's custom FSDP.")
    ddp: MegatronDDPConfig = cfg_field(factory=MegatronDDPConfig, help="DDP options.")
    virtual_pipeline_parallel_size: int = cfg_field(
        1, help="Virtual pipeline stages per rank (>= 2 needs pp > 1)."
    )
    overlap_param_gather_with_optimizer_step: bool = cfg_field(
        False, help="Overlap param gather with the optimizer step."
    )
    use_precision_aware_optimizer: bool = cfg_field(
        False, help="Precision-aware optimizer (forced on by adam_bf16)."
    )
    main_grads_dtype: str = cfg_field("float32", help="Main gradient dtype.")
    main_params_dtype: str = cfg_field("float32", help="Main parameter dtype.")
    exp_avg_dtype: str = cfg_field("float32", help="Adam first-moment dtype.")
    exp_avg_sq_dtype: str = cfg_field("float32", help="Adam second-moment dtype.")
    async_save: bool = cfg_field(False, help="Asynchronous distributed checkpointing.")
    use_checkpoint_opt_param_scheduler: bool = cfg_field(
        True, help="Restore the LR scheduler from the checkpoint."
    )
    use_deterministic_algorithms: bool = cfg_field(False, help="Deterministic kernels.")
    recompute_granularity: str | None = cfg_field(
        "full", help="Activation recompute granularity.", choices=("full", "selective", None)
    )
    recompute_method: str | None = cfg_field(
        "uniform", help="Recompute method.", choices=("uniform", "block", None)
    )
    recompute_num_layers: int | None = cfg_field(1, help="Layers per recompute unit.")
    distribute_saved_activations: bool | None = cfg_field(
        None, help="Distribute saved activations across TP ranks."
    )
    recompute_modules: list[str] | None = cfg_field(None, help="Modules for selective recompute.")
    moe_router_dtype: str | None = cfg_field("fp32", help="MoE router dtype.")
    moe_shared_expert_overlap: bool = cfg_field(False, help="Overlap shared experts.")
    moe_enable_deepep: bool = cfg_field(False, help="Use DeepEP dispatch.")
    moe_permute_fusion: bool = cfg_field(False, help="Fused MoE permutation.")
    moe_router_fusion: bool = cfg_field(False, help="Fused MoE router.")
    moe_token_dispatcher_type: str = cfg_field(
        "alltoall", help="MoE token dispatcher.", choices=("allgather", "alltoall", "flex")
    )
    moe_router_bias_update_rate: float = cfg_field(0.0, help="Aux-loss-free bias update rate.")
    moe_z_loss_coeff: float | None = cfg_field(None, help="Router z-loss coefficient.")
    enable_chunked_logits: bool = cfg_field(False, help="Compute LM-head logits in chunks.")
    entropy_requires_grad: bool = cfg_field(False, help="Backpropagate through entropy.")
    lm_head_loss_chunk_size: int = cfg_field(0, help="Tokens per LM-head chunk (0 = off).")
    enable_fp32_lm_head: bool = cfg_field(False, help="Run the LM head in fp32.")
    cross_entropy_loss_fusion: bool = cfg_field(False, help="Fused cross-entropy.")
    fp8_config: dict[str, Any] | None = cfg_field(None, help="FP8 training options.")
    bridge_type: str = cfg_field(
        "mbridge", help="HF <-> Megatron weight bridge.", choices=("mbridge", "megatron-bridge")
    )
    use_mbridge_save: bool = cfg_field(False, help="Save HF checkpoints through the bridge.")
    use_bridge_for_update_weights: bool = cfg_field(
        False, help="Export weights for inference through the bridge."
    )
    disable_grad_buffers_cpu_backup: bool = cfg_field(False, help="No CPU grad-buffer backup.")
    enable_mtp: bool = cfg_field(False, help="Multi-token-prediction layers.")

    def validate(self) -> None:
        if self.virtual_pipeline_parallel_size < 1:
            raise FieldError("virtual_pipeline_parallel_size", "must be >= 1")
        if self.lm_head_loss_chunk_size < 0:
            raise FieldError("lm_head_loss_chunk_size", "must be >= 0")
        if self.enable_chunked_logits and self.lm_head_loss_chunk_size == 0:
            raise FieldError(
                "lm_head_loss_chunk_size",
                "enable_chunked_logits needs a positive lm_head_loss_chunk_size",
            )


def parse_backend(backend: str) -> ModelAllocation:
    """Parse an engine's ``backend`` string, as a :class:`FieldError` on ``backend``."""
    try:
        return ModelAllocation.from_str(backend)
    except ValueError as e:
        raise FieldError("backend", str(e)) from e


def _rpc_worker_specs() -> tuple[SchedulingSpec, ...]:
    return (SchedulingSpec(cmd=RPC_SERVER_CMD),)


@dataclass
class TrainEngineConfig(ConfigNode):
    """A training engine (FSDP or Megatron) hosted by a group of workers."""

    experiment_name: str = cfg_field(MISSING, help="Experiment name (paths, job names).")
    trial_name: str = cfg_field(MISSING, help="Trial name (paths, job names).")
    path: str = cfg_field("", help="HF model directory to load.")
    attn_impl: str = cfg_field(
        "flash_attention_2", help="HF attention implementation.", choices=ATTN_IMPLS
    )
    use_kernels: bool = cfg_field(
        False,
        help="Fused kernels: torch.compile the log-prob chunks, and the decoder layers (FSDP) or "
        "the rotary embedding, SwiGLU and bias-dropout-add, with fused AdamW (Megatron).",
    )
    init_from_scratch: bool = cfg_field(False, help="Random init from the config, no weights.")
    is_critic: bool = cfg_field(False, help="Value head instead of an LM head.")
    temperature: float = cfg_field(1.0, help="Logits are divided by this before log-probs.")
    logprobs_chunk_size: int = cfg_field(1024, help="Tokens per log-prob chunk (> 0).")
    mb_spec: MicroBatchSpec = cfg_field(factory=MicroBatchSpec, help="Micro-batching.")
    pad_to_maximum: bool = cfg_field(False, help="Pad micro-batches to the token budget.")
    disable_dropout: bool = cfg_field(False, help="Turn dropout off.")
    gradient_checkpointing: bool = cfg_field(False, help="Activation checkpointing.")
    dtype: str = cfg_field("bfloat16", help="Parameter dtype (bf16/fp32/fp16 aliases accepted).")
    grad_reduce_dtype: str = cfg_field("float32", help="Gradient reduction dtype.")
    optimizer_dtype: str = cfg_field("float32", help="Optimizer state dtype (FSDP only).")
    optimizer: OptimizerConfig | None = cfg_field(
        None, help="Optimizer; null means the engine does not train (e.g. ref)."
    )
    weight_update_mode: str = cfg_field(
        "xccl", help="How new weights reach inference.", choices=("disk", "xccl", "awex")
    )
    enable_delta_weight_update: bool = cfg_field(False, help="AWEX: send weight deltas.")
    weight_update_delta_method: str = cfg_field("adamw", help="AWEX: delta method.")
    weight_update_anchor_interval: int = cfg_field(0, help="AWEX: full update every N steps.")
    weight_sync_check: bool = cfg_field(
        False,
        help="After each weight update, compare every inference server's greedy log-probs on "
        "a probe prompt with this engine's on the same tokens (stats weight_sync/*).",
    )
    weight_sync_check_tolerance: float | None = cfg_field(
        None,
        help="Largest |log-prob difference| weight_sync_check accepts before failing the "
        "run; null records the difference only (fp32 on CPU agrees to ~1e-5, bf16 to ~1e-1).",
    )
    fsdp: FSDPEngineConfig = cfg_field(factory=FSDPEngineConfig, help="FSDP options.")
    megatron: MegatronEngineConfig = cfg_field(
        factory=MegatronEngineConfig, help="Megatron options."
    )
    offload: bool = cfg_field(False, help="Offload the engine between uses.")
    use_lora: bool = cfg_field(False, help="Train LoRA adapters.")
    lora_rank: int = cfg_field(32, help="LoRA rank.")
    lora_alpha: int = cfg_field(16, help="LoRA alpha.")
    target_modules: list[str] = cfg_field(factory=list, help="LoRA target modules.")
    peft_type: str = cfg_field("lora", help="PEFT method.")
    enable_tree_training: bool = cfg_field(False, help="Prefix-tree packed training.")
    scheduling_spec: tuple[SchedulingSpec, ...] = cfg_field(
        factory=_rpc_worker_specs, help="Worker resources (1 or 2 specs)."
    )
    scheduling_strategy: SchedulingStrategy = cfg_field(
        factory=SchedulingStrategy, help="Separation or colocation."
    )
    backend: str = cfg_field(
        MISSING, help="Allocation string, e.g. 'fsdp:d8' or 'megatron:(attn:d2t2|ffn:d2e2)'."
    )
    _version: str = cfg_field("v1", help="Controller API version.", choices=("v1", "v2"))

    def validate(self) -> None:
        if self.backend != MISSING:
            allocation = parse_backend(self.backend)
            if allocation.is_inference:
                raise FieldError(
                    "backend",
                    f"{self.backend!r} is an inference backend; a training engine needs "
                    "'fsdp:...' or 'megatron:...'",
                )
        if self.logprobs_chunk_size <= 0:
            raise FieldError("logprobs_chunk_size", f"must be > 0 (got {self.logprobs_chunk_size})")
        if len(self.scheduling_spec) not in (1, 2):
            raise FieldError(
                "scheduling_spec", f"needs 1 or 2 entries (got {len(self.scheduling_spec)})"
            )
        if self.fsdp.memory_efficient_load and self.init_from_scratch:
            raise FieldError(
                "fsdp.memory_efficient_load", "cannot be combined with init_from_scratch"
            )
        for name in ("dtype", "grad_reduce_dtype"):
            value = getattr(self, name)
            if value not in DTYPE_ALIASES:
                raise FieldError(name, f"unknown dtype {value!r}; use bfloat16, float32 or float16")
            setattr(self, name, DTYPE_ALIASES[value])
        canonical = DTYPE_ALIASES.get(self.optimizer_dtype, self.optimizer_dtype)
        if canonical not in ("float32", "bfloat16"):
            raise FieldError("optimizer_dtype", "must be float32 or bfloat16")
        self.optimizer_dtype = canonical


@dataclass
class PPOActorConfig(TrainEngineConfig):
    """The policy being trained: PPO/GRPO loss, reward shaping, advantages."""

    ppo_n_minibatches: int = cfg_field(4, help="Optimizer steps per training batch.")
    eps_clip: float = cfg_field(0.2, help="PPO ratio clip (lower, and upper when not split).")
    eps_clip_higher: float | None = cfg_field(None, help="Upper ratio clip (DAPO clip-higher).")
    c_clip: float | None = cfg_field(None, help="Dual-clip constant (> 1) for negative advantages.")
    m2_threshold: float | None = cfg_field(None, help="M2PO second-moment threshold.")
    reward_norm: NormConfig | None = cfg_field(None, help="Reward normalization.")
    reward_scaling: float = cfg_field(1.0, help="reward = (reward + bias) x scaling.")
    reward_bias: float = cfg_field(0.0, help="Added to rewards before scaling.")
    reward_clip: float = cfg_field(20.0, help="Rewards are clipped to [-clip, clip].")
    overlong_reward_penalty: bool = cfg_field(False, help="Penalize near-limit responses.")
    overlong_tokens: int | None = cfg_field(
        None, help="Tokens before the limit that are penalized."
    )
    overlong_penalty_factor: float | None = cfg_field(None, help="Penalty at the limit.")
    mask_no_eos_with_zero: bool = cfg_field(False, help="Zero reward for truncated outputs.")
    discount: float = cfg_field(1.0, help="GAE discount gamma.")
    gae_lambda: Any = cfg_field(
        1.0, help="GAE lambda: a number, or the dotted path of a per-trajectory lambda function."
    )
    gae_lambda_kwargs: dict[str, Any] = cfg_field(
        factory=dict, help="Keyword arguments of a lambda function."
    )
    gae_timestep_unit: str = cfg_field(
        "token", help="GAE over tokens or over turns.", choices=("token", "turn")
    )
    adv_norm: NormConfig | None = cfg_field(None, help="Advantage normalization.")
    kl_ctl: float = cfg_field(
        0.1,
        help="KL penalty coefficient (>= 0): -kl_ctl x KL(old || ref) is added to each token's "
        "reward. > 0 builds a reference model: `ref`, or a frozen copy of the actor next to "
        "its workers; 0 turns the penalty and the ref off.",
    )
    kl_estimator: str = cfg_field("k1", help="KL estimator.", choices=("k1", "k2", "k3"))
    use_sapo_loss: bool = cfg_field(False, help="SAPO soft-gated loss.")
    sapo_tau_pos: float = cfg_field(1.0, help="SAPO temperature for positive advantages.")
    sapo_tau_neg: float = cfg_field(1.05, help="SAPO temperature for negative advantages.")
    use_cispo_loss: bool = cfg_field(False, help="CISPO clipped-IS-weight loss.")
    recompute_logprob: bool = cfg_field(False, help="Recompute log-probs before the update.")
    use_decoupled_loss: bool = cfg_field(
        False, help="Decoupled PPO: proximal policy separate from the behaviour policy."
    )
    rejection_sampling: RejectionSamplingConfig | None = cfg_field(
        None, help="Mask/clamp tokens with large behaviour mismatch."
    )
    importance_sampling_level: str = cfg_field(
        "token", help="Ratio per token, or per sequence (GSPO).", choices=("token", "sequence")
    )
    prox_logp_method: str = cfg_field(
        "recompute",
        help="How proximal log-probs are obtained.",
        choices=("recompute", "loglinear", "reuse_train_logp"),
    )
    log_agent_stats: bool = cfg_field(False, help="Log per-agent statistics.")
    log_agent_stats_keys: list[str] = cfg_field(factory=list, help="Keys of agent statistics.")
    max_new_tokens: int = cfg_field(1024, help="Generation budget (used for overlong penalty).")

    def validate(self) -> None:
        super().validate()
        self._validate_gae_lambda()
        norm = self.reward_norm
        if norm is not None and norm.group_size == 1 and norm.mean_level == "group":
            self.warn(
                "actor.reward_norm.mean_level is 'group' with group_size 1; the real "
                "per-prompt group sizes are used at run time"
            )
        if self.prox_logp_method == "reuse_train_logp" and self.ppo_n_minibatches != 1:
            self.warn("prox_logp_method 'reuse_train_logp' forces ppo_n_minibatches=1")
            self.ppo_n_minibatches = 1
        if self.ppo_n_minibatches < 1:
            raise FieldError("ppo_n_minibatches", "must be >= 1")
        if not (math.isfinite(self.kl_ctl) and self.kl_ctl >= 0):
            raise FieldError(
                "kl_ctl", f"must be a finite number >= 0 (got {self.kl_ctl}); 0 turns KL off"
            )
        if self.enable_delta_weight_update and self.ppo_n_minibatches != 1:
            raise FieldError(
                "enable_delta_weight_update", "delta weight updates need ppo_n_minibatches=1"
            )
        if self.rejection_sampling is not None and not self.use_decoupled_loss:
            self.warn("actor.rejection_sampling is set but use_decoupled_loss is false")
        if self.use_decoupled_loss and self.rejection_sampling is None:
            self.warn("actor.use_decoupled_loss is on without rejection_sampling")
        if self.use_sapo_loss:
            if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
                raise FieldError("sapo_tau_pos", "SAPO needs positive temperatures")
            if self.use_decoupled_loss:
                raise FieldError("use_sapo_loss", "SAPO cannot be combined with decoupled loss")
        if self.use_cispo_loss:
            if self.use_sapo_loss:
                raise FieldError("use_cispo_loss", "CISPO cannot be combined with SAPO")
            if not (self.eps_clip_higher is not None and self.eps_clip_higher > 0):
                raise FieldError("eps_clip_higher", "CISPO needs eps_clip_higher > 0")
            if self.importance_sampling_level != "token":
                raise FieldError("importance_sampling_level", "CISPO needs level 'token'")

    def _validate_gae_lambda(self) -> None:
        value = self.gae_lambda
        if isinstance(value, bool):
            raise FieldError("gae_lambda", "must be a number or a dotted function path, not a bool")
        if isinstance(value, (int, float)):
            if not math.isfinite(value):
                raise FieldError("gae_lambda", "must be finite")
            self.gae_lambda = float(value)
            return
        if isinstance(value, str):
            try:
                self.gae_lambda = float(value)
                return
            except ValueError:
                pass
            if not value.strip() or "." not in value:
                raise FieldError(
                    "gae_lambda",
                    f"{value!r} is neither a number nor a dotted path 'package.module.fn'",
                )
            self.gae_lambda = value.strip()
            return
        raise FieldError("gae_lambda", f"must be a number or a dotted path (got {value!r})")

    def should_compute_prox_logp(self) -> bool:
        """Whether a separate forward pass computes proximal log-probs."""
        if self.use_decoupled_loss:
            return self.prox_logp_method not in ("loglinear", "reuse_train_logp")
        return self.recompute_logprob


@dataclass
class PPOCriticConfig(TrainEngineConfig):
    """A value model (not used by the Arena profiles)."""

    ppo_n_minibatches: int = cfg_field(4, help="Optimizer steps per training batch.")
    eps_clip: float = cfg_field(0.5, help="Value clip.")
    mask_no_eos_with_zero: bool = cfg_field(False, help="Zero values for truncated outputs.")


@dataclass
class TeacherConfig(TrainEngineConfig):
    """A frozen teacher model; accepted for YAML compatibility, not used by this port."""
