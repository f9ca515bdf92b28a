"""Building the Megatron engine's model and optimizer without Transformer Engine.

The layer spec (Megatron's local modules with the packed causal attention of
:mod:`areal.engine.attention`), the ``TransformerConfig`` fields the engine sets on top of
mbridge's mapping, the FP32 LM head, and Megatron's optimizer with the engine's settings.
megatron-core is imported inside functions only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from areal.api.cli_args import TrainEngineConfig
from areal.engine.attention import packed_causal_attention
from areal.engine.context_parallel import context_parallel_attention
from areal.engine.train_common import to_dtype

__all__ = [
    "build_megatron_optimizer",
    "clip_grad_norm",
    "fp32_lm_head",
    "fusable_activation",
    "fuse_torch_adam",
    "local_layer_spec",
    "packed_core_attention_class",
    "packed_seq_params_class",
    "sequence_parallel_for",
    "transformer_overrides",
    "unwrap",
]


# --- layers: Megatron's local modules, packed attention ---


@functools.cache
def packed_seq_params_class():
    """Megatron's ``PackedSeqParams`` with the rank's context-parallel share of the stream.

    ``context_shard`` (a :class:`~areal.engine.context_parallel.ContextShard`, ``None`` at
    ``c1``) rides along with the packed-sequence parameters, which Megatron hands unchanged
    to every attention module, recomputation included.
    """
    from dataclasses import dataclass
    from typing import Any as AnyShard

    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclass
    class ShardedPackedSeqParams(PackedSeqParams):
        context_shard: AnyShard = None

    return ShardedPackedSeqParams


@functools.cache
def packed_core_attention_class():
    """A Megatron core-attention module computing causal attention per packed segment."""
    from megatron.core.transformer.module import MegatronModule

    class PackedCoreAttention(MegatronModule):
        """Drop-in for ``DotProductAttention`` taking THD input with ``PackedSeqParams``.

        ``query`` ``[T, Hq, D]``, ``key``/``value`` ``[T, Hkv, D]`` (Megatron squeezes the
        batch dim for THD); returns ``[T, Hq, D]``. Attention never crosses a segment.
        Under context parallelism ``T`` is this rank's share (``packed_seq_params.
        context_shard``): keys and values are gathered over the CP group.
        """

        def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
            super().__init__(config=config)
            self.softmax_scale = kwargs.get("softmax_scale")

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):  # fmt: skip
            if packed_seq_params is None:
                raise ValueError("PackedCoreAttention needs packed (THD) inputs")
            shard = getattr(packed_seq_params, "context_shard", None)
            if shard is not None and shard.size > 1:
                return context_parallel_attention(
                    query, key, value, shard, scale=self.softmax_scale
                )
            cu = packed_seq_params.cu_seqlens_q
            return packed_causal_attention(
                query, key, value, cu, int(packed_seq_params.max_seqlen_q),
                scale=self.softmax_scale,
            )  # fmt: skip

    return PackedCoreAttention


def local_layer_spec(bridge: Any, vp_stage: int | None = None):
    """mbridge's decoder block spec, built from Megatron's local modules.

    A bridge with layers GPT's spec does not know (Ling 3's KDA / MLA hybrid) builds its own
    local spec: its ``local_layer_spec(vp_stage)`` is used instead.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    own_spec = getattr(bridge, "local_layer_spec", None)
    if own_spec is not None:
        return own_spec(vp_stage)

    kwargs = {"vp_stage": vp_stage} if vp_stage is not None else {}
    spec = get_gpt_decoder_block_spec(bridge.config, use_transformer_engine=False, **kwargs)
    attention_cls = packed_core_attention_class()
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = attention_cls
    return spec


# --- TransformerConfig ---


def sequence_parallel_for(bridge: Any, tp_size: int) -> bool:
    """Whether the model runs with sequence parallelism: at ``tp_size > 1`` for bridges that
    ask for it (``sequence_parallel_with_tp``, Ling 3: Megatron trains MoE layers under
    tensor parallelism only with it, and its local norms refuse it, so such a bridge builds
    its own). Every other model keeps it off."""
    return tp_size > 1 and bool(getattr(bridge, "sequence_parallel_with_tp", False))


def transformer_overrides(
    config: TrainEngineConfig,
    device: torch.device,
    model_config: Any,
    sequence_parallel: bool = False,
) -> dict[str, Any]:
    """``TransformerConfig`` fields the engine sets on top of mbridge's mapping.

    ``model_config`` is the bridge's ``TransformerConfig`` (its activation decides whether
    Megatron's fused bias-activation applies); ``sequence_parallel`` comes from
    :func:`sequence_parallel_for`.
    """
    mcfg = config.megatron
    extra: dict[str, Any] = {
        # fused kernels that need Apex / Transformer Engine / compiled extensions
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        # Megatron's local (non-Transformer-Engine) norms cannot split the sequence over TP
        "sequence_parallel": sequence_parallel,
        "deterministic_mode": mcfg.use_deterministic_algorithms,
        "moe_token_dispatcher_type": mcfg.moe_token_dispatcher_type,
        "moe_router_dtype": mcfg.moe_router_dtype,
        "moe_router_bias_update_rate": mcfg.moe_router_bias_update_rate,
        "moe_z_loss_coeff": mcfg.moe_z_loss_coeff,
        "moe_grouped_gemm": False,
    }
    if device.type == "cpu":
        extra["use_cpu_initialization"] = True
    if config.disable_dropout:
        extra.update(attention_dropout=0.0, hidden_dropout=0.0)
    if config.use_kernels:
        # Megatron's own fused SwiGLU / GeGLU and bias-dropout-add: torch.compile'd
        # functions (megatron.core.jit), no extension needed
        extra["bias_dropout_fusion"] = True
        extra["bias_activation_fusion"] = fusable_activation(model_config)
    if config.gradient_checkpointing and mcfg.recompute_granularity:
        full = mcfg.recompute_granularity == "full"
        extra.update(
            recompute_granularity=mcfg.recompute_granularity,
            recompute_method=mcfg.recompute_method if full else None,
            recompute_num_layers=mcfg.recompute_num_layers if full else None,
        )
        if mcfg.recompute_modules:
            extra["recompute_modules"] = list(mcfg.recompute_modules)
    return extra


def fusable_activation(config: Any) -> bool:
    """Whether Megatron's fused bias-activation (``bias_activation_fusion``) covers this MLP:
    SwiGLU, GeGLU, or GeLU with a bias; anything else raises inside Megatron."""
    from torch.nn import functional

    act = getattr(config, "activation_func", None)
    gated = bool(getattr(config, "gated_linear_unit", False))
    if act is functional.silu:
        return gated
    return act is functional.gelu and (gated or bool(getattr(config, "add_bias_linear", False)))


# --- the LM head ---


def fp32_lm_head(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: run the output layer's matmul in float32."""
    weight = kwargs.get("weight")
    kwargs["weight"] = (module.weight if weight is None else weight).float()
    return (args[0].float(), *args[1:]), kwargs


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


# --- optimizer ---


def build_megatron_optimizer(config: TrainEngineConfig, model: list[torch.nn.Module]) -> Any:
    """Megatron's (distributed) optimizer over the chunks' DDP buffers, wired into the
    model config the pipeline schedule reads (gradient finalization, loss scale, no-sync)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import get_model_config

    opt, mcfg = config.optimizer, config.megatron
    if opt.type not in ("adam", "sgd"):
        raise ValueError(
            f"optimizer.type {opt.type!r} is not supported by the Megatron engine; use adam or sgd"
        )
    if opt.type == "sgd" and mcfg.ddp.use_distributed_optimizer:
        raise ValueError(
            "optimizer.type sgd: Megatron's distributed optimizer supports Adam only; "
            "use adam or set megatron.ddp.use_distributed_optimizer: false"
        )
    dtype = to_dtype(config.dtype)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=opt.type,
            lr=opt.lr,
            min_lr=opt.lr * opt.min_lr_ratio,
            weight_decay=opt.weight_decay,
            adam_beta1=opt.beta1,
            adam_beta2=opt.beta2,
            adam_eps=opt.eps,
            sgd_momentum=0.0,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            initial_loss_scale=opt.initial_loss_scale,
            min_loss_scale=opt.min_loss_scale,
            loss_scale_window=opt.loss_scale_window,
            hysteresis=opt.hysteresis,
            clip_grad=opt.gradient_clipping,
            use_distributed_optimizer=mcfg.ddp.use_distributed_optimizer,
            use_precision_aware_optimizer=mcfg.use_precision_aware_optimizer,
        ),
        model,
    )
    if config.use_kernels:
        fuse_torch_adam(optimizer)
    model_config = get_model_config(model[0])
    model_config.finalize_model_grads_func = finalize_model_grads
    model_config.grad_scale_func = optimizer.scale_loss
    no_sync = [chunk.no_sync for chunk in model]
    model_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return optimizer


def clip_grad_norm(optimizer: Any, max_norm: float) -> float:
    """Clip the gradients by their total norm over every parameter; returns that norm.

    Megatron's ``clip_grad_norm`` needs a single inner optimizer, and a chained one (expert
    parameters apart from dense ones) has several: each part is clipped by the chain's total
    norm, as Megatron's own ``ChainedOptimizer.step`` does.
    """
    parts = getattr(optimizer, "chained_optimizers", None)
    if parts is None or len(parts) == 1:
        return float(optimizer.clip_grad_norm(max_norm))
    from megatron.core.optimizer import optimizer as mcore_optimizer

    total = float(optimizer.get_grad_norm())
    for part in parts:
        params = part.get_parameters()
        if not params or getattr(part, "is_stub_optimizer", False):
            continue
        mcore_optimizer.clip_grad_by_total_norm_fp32(
            params,
            max_norm=max_norm,
            total_norm=total,
            use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
        )
    return total


def fuse_torch_adam(optimizer: Any) -> int:
    """Switch the torch Adam(W) inside Megatron's optimizer wrappers to its fused kernel
    (``use_kernels``): one kernel per step instead of ~8 ``foreach`` passes. Without Apex or
    Transformer Engine, Megatron steps a plain torch optimizer; this must run before its
    first step, so every ``step`` state is created on the parameters' device. Returns how
    many optimizers were switched."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    switched = 0
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or inner.state:
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if not params or any(p.device.type not in supported or not p.is_floating_point()
                             for p in params):  # fmt: skip
            continue
        inner.defaults.update(fused=True, foreach=False)
        for group in inner.param_groups:
            group.update(fused=True, foreach=False)
        switched += 1
    return switched
