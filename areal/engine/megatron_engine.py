"""``MegatronEngine``: a Hugging Face checkpoint trained on megatron-core, bridged by mbridge.

* Process groups: Megatron-Core's tensor / pipeline / context / expert / data groups from
  the allocation string (``megatron:d2t2p1``, or ``megatron:(attn:...|ffn:...)`` for MoE),
  in Megatron's ``tp-cp-ep-dp-pp`` order, plus a gloo group over every rank.
* Model: ``mbridge.AutoBridge`` turns the HF config into a ``TransformerConfig`` and a
  ``GPTModel`` (one chunk per virtual pipeline stage), loads the HF safetensors into the
  sharded parameters and exports them back under HF names. Layers use Megatron's local
  (non Transformer Engine) modules with this module's packed causal attention, so the
  engine runs where only torch is installed.
* Micro-batches: the same packed varlen streams as :class:`FSDPEngine` (THD layout with
  ``cu_seqlens``), run through Megatron's pipeline schedule (``get_forward_backward_func``).
  Log-probs come from the vocab-parallel logits (log-sum-exp reduced over the TP group).
* ``train_batch``: each micro-batch loss is weighted ``w_mb / W`` (``W`` summed over the
  data-parallel ranks) and multiplied by the DP size and by the number of micro-batches,
  which undoes the schedule's division by the micro-batch count and DDP's gradient
  averaging: one step optimizes the token mean of the global batch, as FSDP does (§7.4).
* Optimizer: Megatron's (distributed) optimizer over DDP gradient buffers; the global
  gradient norm is clipped and a non-finite norm skips the step. LR schedule: the same
  warmup + constant/linear/cosine multiplier as the FSDP engine.
* Checkpoints: HF safetensors exported through the bridge (rank 0 writes) and Megatron's
  distributed checkpoint (torch DCP format) for recover, optimizer optional.
* Weight sync to inference: over disk (HF export) or NCCL in buckets from rank 0, with the
  same protocol as the FSDP engine; the bridge gathers TP/PP/EP shards for every tensor.

megatron-core and mbridge are imported inside methods only: importing this module needs
neither (``pip install 'areal-arena[megatron]'`` for using it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal.api.cli_args import TrainEngineConfig
from areal.api.engine_api import InferenceEngine, TrainEngine
from areal.api.io_struct import FinetuneSpec
from areal.engine.attention import packed_causal_attention
from areal.engine.checkpoint import CheckpointFormats, read_extra_state, write_extra_state
from areal.engine.fsdp_engine import (
    PROCESS_GROUP_TIMEOUT,
    LossFn,
    WeightFn,
    _flat,
    init_default_process_group,
    mask_last_tokens,
    to_dtype,
)
from areal.engine.logprobs import gather_logprobs, next_token_labels
from areal.engine.optim import lr_multiplier
from areal.engine.weight_sync import RolloutWeightSync
from areal.utils import logging
from areal.utils.packing import split_padded_tensor_dict_into_mb_list

__all__ = ["MegatronEngine", "vocab_parallel_logprobs"]

logger = logging.getLogger("engine.megatron")

HF_SHARD_BYTES = 3 * 2**30
# Megatron's local layer spec names the two RMSNorms of a layer as modules of their own;
# mbridge only knows the Transformer Engine names, where they are fused into the linears.
LOCAL_SPEC_OTHER = {
    "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]
}
LOCAL_SPEC_MLP = {
    "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]
}


# --- log-probs over a vocab-parallel LM head ---


def vocab_parallel_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, tp_group: Any, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits / temperature)`` at ``labels``, and the entropy, for vocab shards.

    ``logits`` ``[T, V / tp]`` (this rank's slice of the vocabulary, any float dtype),
    ``labels`` ``[T]`` global token ids. Returns ``(logp [T], entropy [T])`` in float32;
    ``logp`` is differentiable (Megatron's vocab-parallel cross entropy), ``entropy`` is
    detached and only reported.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    with torch.no_grad():
        entropy = _vocab_parallel_entropy(logits, tp_group)
    # the cross entropy shifts its input in place: give it its own copy
    logp = -vocab_parallel_cross_entropy(logits.clone(), labels.long())
    return logp, entropy


def _vocab_parallel_entropy(logits: torch.Tensor, tp_group: Any) -> torch.Tensor:
    # H = lse - sum_v p_v * logit_v, with max, sum-exp and the weighted sum reduced over TP
    peak = logits.max(-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - peak[:, None]
    sum_exp = shifted.exp().sum(-1)
    dist.all_reduce(sum_exp, group=tp_group)
    probs = (shifted - sum_exp.log()[:, None]).exp()
    weighted = (probs * shifted).sum(-1)
    dist.all_reduce(weighted, group=tp_group)
    return sum_exp.log() - weighted


# --- rotary embedding for packed streams, without host syncs ---


def _packed_positions(n_tokens: int, rows: int, cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """Each token's position in its own segment (``[T]`` long), found on the device; all
    of ``0..T-1`` when ``freqs`` has a row per stream token (Megatron's offset mode)."""
    index = torch.arange(n_tokens, device=device, dtype=torch.long)
    if rows == n_tokens:
        return index
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    segment = torch.searchsorted(bounds[1:].contiguous(), index, right=True)
    return index - bounds[segment.clamp(max=bounds.numel() - 2)]


def _rope_at(
    t: torch.Tensor,
    freqs: torch.Tensor,
    positions: torch.Tensor,
    rotary_interleaved: bool,
    multi_latent_attention: bool,
) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    rotated = _apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs[positions],
        rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention,
    )
    return rotated.squeeze(1)


def _packed_rope(
    t: torch.Tensor,
    freqs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rotary_interleaved: bool,
    multi_latent_attention: bool,
    compiled: bool = False,
) -> torch.Tensor:
    """Megatron's unfused THD rotary embedding without its per-call ``tolist()``.

    ``t`` ``[T, H, D]``, ``freqs`` ``[S, 1, 1, d]``, ``cu_seqlens`` ``[n + 1]`` on the device.
    Token ``i`` of the segment starting at ``cu_seqlens[k]`` gets ``freqs[i - cu_seqlens[k]]``
    (``freqs[i]`` when ``freqs`` covers the whole stream, as Megatron's offset mode does):
    the same values as Megatron's split-and-concatenate loop (one context-parallel rank),
    found on the device, so no layer waits for the host.

    ``compiled`` (``use_kernels``): the frequency lookup, cos/sin and rotation run as one
    ``torch.compile`` graph instead of a dozen memory passes; if the compiler fails on this
    platform, a warning says so and the eager maths is used from then on.
    """
    global _ROPE_COMPILE_FAILED
    positions = _packed_positions(t.shape[0], freqs.shape[0], cu_seqlens, t.device)
    args = (t, freqs, positions, rotary_interleaved, multi_latent_attention)
    if compiled and not _ROPE_COMPILE_FAILED:
        try:
            return _compiled_rope_at()(*args)
        except Exception as e:  # an Inductor lowering missing on this platform
            _ROPE_COMPILE_FAILED = True
            logger.warning("compiled rotary embedding failed (%s); using the eager one", e)
    return _rope_at(*args)


_ROPE_COMPILE_FAILED = False


@functools.cache
def _compiled_rope_at():
    return torch.compile(_rope_at, dynamic=True)


def _fusable_activation(config: Any) -> bool:
    """Whether Megatron's fused bias-activation (``bias_activation_fusion``) covers this MLP:
    SwiGLU, GeGLU, or GeLU with a bias; anything else raises inside Megatron."""
    from torch.nn import functional

    act = getattr(config, "activation_func", None)
    gated = bool(getattr(config, "gated_linear_unit", False))
    if act is functional.silu:
        return gated
    return act is functional.gelu and (gated or bool(getattr(config, "add_bias_linear", False)))


def _fuse_torch_adam(optimizer: Any) -> int:
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


# set on a model's TransformerConfig by an engine with use_kernels: its layers take the
# compiled rotary embedding (the hook below is process-wide, the choice is per model)
_COMPILED_ROPE = "_areal_compiled_rope"


def _install_packed_rope() -> None:
    """Route Megatron attention's unfused THD rotary calls through :func:`_packed_rope`.

    Megatron's version copies the segment lengths to the host on every call (twice per
    layer per micro-batch), which left the GPU idle half of a training step. Fused rotary
    (Transformer Engine), context parallelism and YaRN scaling keep Megatron's own path.
    """
    from megatron.core.transformer import attention

    original = attention.apply_rotary_pos_emb
    if getattr(original, "_areal_packed", False):
        return

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        if (
            cu_seqlens is None
            or config.apply_rope_fusion
            or mscale != 1.0
            or (cp_group is not None and cp_group.size() > 1)
        ):
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale,
                            cp_group=cp_group)  # fmt: skip
        return _packed_rope(
            t, freqs, cu_seqlens, config.rotary_interleaved, config.multi_latent_attention,
            compiled=getattr(config, _COMPILED_ROPE, False),
        )  # fmt: skip

    apply_rotary_pos_emb._areal_packed = True
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb


# --- gradient norm without Apex, without a host sync per parameter ---


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for Megatron's Apex-less ``multi_tensor_l2norm`` fallback: the global L2 norm
    of every tensor, as a ``[1]`` float32 tensor on their device.

    Megatron's fallback reads each parameter's norm on the host (one GPU wait per
    parameter, twice per step); ``torch._foreach_norm`` keeps it on the device.
    """
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors)])
    return torch.linalg.vector_norm(norms).reshape(1), None


def _install_foreach_l2_norm() -> None:
    """Use :func:`_foreach_l2_norm` where Megatron fell back to its local L2 norm."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if getattr(clip_grads, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _foreach_l2_norm


# --- attention for packed streams without Transformer Engine ---


def _packed_core_attention_class():
    """A Megatron core-attention module computing causal attention per packed segment."""
    from megatron.core.transformer.module import MegatronModule

    class PackedCoreAttention(MegatronModule):
        """Drop-in for ``DotProductAttention`` taking THD input with ``PackedSeqParams``.

        ``query`` ``[T, Hq, D]``, ``key``/``value`` ``[T, Hkv, D]`` (Megatron squeezes the
        batch dim for THD); returns ``[T, Hq, D]``. Attention never crosses a segment.
        """

        def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
            super().__init__(config=config)
            if config.context_parallel_size != 1:
                raise ValueError("context parallelism needs Transformer Engine attention")
            self.softmax_scale = kwargs.get("softmax_scale")

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):  # fmt: skip
            if packed_seq_params is None:
                raise ValueError("PackedCoreAttention needs packed (THD) inputs")
            cu = packed_seq_params.cu_seqlens_q
            return packed_causal_attention(
                query, key, value, cu, int(packed_seq_params.max_seqlen_q),
                scale=self.softmax_scale,
            )  # fmt: skip

    return PackedCoreAttention


def _local_layer_spec(bridge: Any, vp_stage: int | None = None):
    """mbridge's decoder block spec, built from Megatron's local modules."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    kwargs = {"vp_stage": vp_stage} if vp_stage is not None else {}
    spec = get_gpt_decoder_block_spec(bridge.config, use_transformer_engine=False, **kwargs)
    attention_cls = _packed_core_attention_class()
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = attention_cls
    return spec


def _fix_bridge(bridge: Any) -> None:
    """Per-instance adjustments so mbridge 0.15.1 works with transformers 5 and local layers."""
    hf = bridge.hf_config
    if not hasattr(hf, "rope_theta"):  # transformers 5 moved it into rope_parameters
        params = getattr(hf, "rope_parameters", None) or {}
        hf.rope_theta = params.get("rope_theta", 10000.0)
    # the class-level dicts are shared (and edited for tied models); keep private copies
    direct = dict(type(bridge)._DIRECT_MAPPING)
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    direct["output_layer.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"
    bridge._DIRECT_MAPPING = direct
    bridge._OTHER_MAPPING = {**type(bridge)._OTHER_MAPPING, **LOCAL_SPEC_OTHER}
    bridge._MLP_MAPPING = {**LOCAL_SPEC_MLP, **type(bridge)._MLP_MAPPING}
    bridge._get_transformer_layer_spec = functools.partial(_local_layer_spec, bridge)
    bridge.has_vp_stage = True
    if getattr(hf, "num_experts", None):
        _define_missing_te_gemm()
        original = bridge._weight_name_mapping_mcore_local_to_global
        bridge._weight_name_mapping_mcore_local_to_global = functools.partial(
            _grouped_expert_names, bridge, original
        )


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's MoE router reads ``te_general_gemm`` from ``moe_utils``, which
    only defines it when Transformer Engine imports; without TE the router raised
    NameError. ``None`` is the value its own fallback (a plain matmul) tests for."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def _grouped_expert_names(bridge: Any, original: Any, model: Any, consider_ep: bool = True):
    """mbridge's local-to-global name map, with local experts named as grouped ones.

    Without Transformer Engine, Megatron builds MoE experts as ``SequentialMLP``, whose
    parameters are ``...mlp.experts.local_experts.{i}.linear_fc1.weight``; mbridge's HF
    mappings know the grouped names ``...mlp.experts.linear_fc1.weight{i}``. Expert
    indices become global (``i + experts_per_rank * ep_rank``) when ``consider_ep``.
    """
    names = original(model, consider_ep=False)  # pipeline layer numbering only
    per_rank = bridge.config.num_moe_experts // bridge.mpu.ep_size
    offset = per_rank * bridge.mpu.ep_rank if consider_ep else 0
    for local, name in names.items():
        match = _LOCAL_EXPERT.match(name)
        if match:
            prefix, index, linear = match.groups()
            names[local] = f"{prefix}.{linear}.weight{int(index) + offset}"
    return names


def _pass_hidden_through(
    head: torch.nn.Module,
    weights: list[torch.Tensor],
    input_: torch.Tensor,
    weight: torch.Tensor | None = None,
    runtime_gather_output: bool | None = None,
):
    """The output layer's ``forward`` for the chunked head: its input comes out unchanged and
    the weight it would have used (tied or its own, after any pre-hook) is left in
    ``weights`` for the loss function of the same micro-batch."""
    del runtime_gather_output  # one tensor-parallel rank: nothing to gather
    weights.append(head.weight if weight is None else weight)
    return input_, None


def _fp32_lm_head(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: run the output layer's matmul in float32."""
    weight = kwargs.get("weight")
    kwargs["weight"] = (module.weight if weight is None else weight).float()
    return (args[0].float(), *args[1:]), kwargs


class MegatronEngine(CheckpointFormats, RolloutWeightSync, TrainEngine):
    def __init__(self, config: TrainEngineConfig):
        self.config = config
        self.model: list[torch.nn.Module] = []
        self.bridge: Any = None
        self.optimizer: Any = None
        self.tokenizer: Any = None
        self.device = torch.device("cpu")
        self.parallel: Any = None
        self._cpu_group: dist.ProcessGroup | None = None
        self._mp_group: dist.ProcessGroup | None = None
        self._reporter_group: dist.ProcessGroup | None = None
        self._reporters: list[int] = []
        self._own_process_group = False
        self._groups_ready = False
        self._version = 0
        self._lr_step = 0
        self._total_steps = 1
        self._training = True
        self.rollout_engine: InferenceEngine | None = None
        self._weight_group: dist.ProcessGroup | None = None

    # --- process groups ---

    def _strategy(self, parallel_strategy: Any, world: int):
        from areal.api.alloc_mode import ModelAllocation, ParallelStrategy

        if parallel_strategy is None:
            backend = getattr(self.config, "backend", None)
            if isinstance(backend, str) and backend.startswith("megatron"):
                parallel_strategy = ModelAllocation.from_str(backend).parallel
            else:
                parallel_strategy = ParallelStrategy(data_parallel_size=world)
        if parallel_strategy.world_size != world:
            raise ValueError(
                f"the allocation spans {parallel_strategy.world_size} ranks "
                f"(d{parallel_strategy.dp_size} t{parallel_strategy.tp_size} "
                f"p{parallel_strategy.pp_size} c{parallel_strategy.cp_size}) but "
                f"torch.distributed has {world}"
            )
        if parallel_strategy.cp_size > 1:
            raise ValueError(
                "context parallelism (c > 1) needs Transformer Engine attention, which this "
                "engine does not use; use t (tensor) or p (pipeline) parallelism instead"
            )
        return parallel_strategy

    def create_process_group(self, parallel_strategy: Any = None) -> None:
        from megatron.core import parallel_state, tensor_parallel

        device, created = init_default_process_group()
        if device is not None:
            self.device = device
        self._own_process_group = self._own_process_group or created
        p = self.parallel = self._strategy(parallel_strategy, dist.get_world_size())
        vpp = self.config.megatron.virtual_pipeline_parallel_size
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tp_size,
            pipeline_model_parallel_size=p.pp_size,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            context_parallel_size=p.cp_size,
            expert_model_parallel_size=p.ep_size,
            expert_tensor_parallel_size=p.etp_size,
            order="tp-cp-ep-dp-pp",
        )
        if device is not None:
            tensor_parallel.model_parallel_cuda_manual_seed(1)
        self._cpu_group = (
            dist.new_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)
            if dist.get_backend() != "gloo"
            else dist.group.WORLD
        )
        self._mp_group = parallel_state.get_model_parallel_group()
        # ranks whose loss and statistics count: one per data-parallel replica
        reporter = (
            parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0
            and parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        )
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, reporter, group=self._cpu_group)
        self._reporters = [r for r, flag in enumerate(flags) if flag]
        self._reporter_group = dist.new_group(
            self._reporters, backend="gloo", timeout=PROCESS_GROUP_TIMEOUT
        )
        self._groups_ready = True

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    @property
    def data_parallel_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def data_parallel_world_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    @property
    def cpu_group(self) -> dist.ProcessGroup:
        return self._cpu_group

    @property
    def context_and_model_parallel_group(self) -> dist.ProcessGroup:
        return self._mp_group

    def current_data_parallel_head(self) -> int:
        return min(dist.get_process_group_ranks(self._mp_group))

    @property
    def _tp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    @property
    def _is_last_stage(self) -> bool:
        from megatron.core import parallel_state

        return parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    # --- model ---

    def initialize(
        self, addr: str | None = None, ft_spec: FinetuneSpec | None = None, **kwargs: Any
    ) -> None:
        if addr is not None:
            raise ValueError("MegatronEngine.initialize takes no address (addr must be None)")
        if not self._groups_ready:
            self.create_process_group(kwargs.get("parallel_strategy"))
        from mbridge import AutoBridge

        cfg = self.config
        if not cfg.path:
            raise ValueError("actor.path must name an HF model directory")
        dtype = to_dtype(cfg.dtype)
        self.bridge = AutoBridge.from_pretrained(cfg.path, dtype=dtype)
        _fix_bridge(self.bridge)
        _install_packed_rope()
        _install_foreach_l2_norm()
        self.bridge.set_extra_args(**self._transformer_overrides())
        train = cfg.optimizer is not None
        mcfg = cfg.megatron
        ddp = dataclasses.asdict(mcfg.ddp) if hasattr(mcfg.ddp, "__dataclass_fields__") else {}
        ddp = {k: v for k, v in ddp.items() if not k.startswith("_")}
        self.model = self.bridge.get_model(
            wrap_with_ddp=train,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            ddp_config=ddp,
            use_cpu_initialization=self.device.type == "cpu",
            data_parallel_random_init=False,
        )
        if not cfg.init_from_scratch:
            self.bridge.load_weights(self.model, cfg.path)
        if cfg.use_kernels:
            configs = {id(m.config): m.config for c in self.model for m in c.modules()
                       if getattr(m, "config", None) is not None}  # fmt: skip
            for config in configs.values():
                setattr(config, _COMPILED_ROPE, True)
        if mcfg.enable_fp32_lm_head and self._is_last_stage:
            for chunk in self.model:
                head = getattr(_unwrap(chunk), "output_layer", None)
                if head is not None:
                    head.register_forward_pre_hook(_fp32_lm_head, with_kwargs=True)
        self._head_weights: list[torch.Tensor] = []
        self._chunked_head = self._install_chunked_head()
        if train:
            self._build_optimizer()
            self._total_steps = ft_spec.total_train_steps if ft_spec is not None else 1
            self._apply_lr()
        self._load_tokenizer()
        logger.info(
            "Megatron engine ready: %s on %d %s rank(s) (%s), compute %s",
            cfg.path,
            dist.get_world_size(),
            self.device.type,
            self.parallel,
            cfg.dtype,
        )

    def _install_chunked_head(self) -> bool:
        """Without tensor parallelism, the output layer hands its input through and the loss
        computes log-probs chunk by chunk from it (:func:`gather_logprobs`), as the FSDP
        engine does: no ``[T, vocab]`` logits are kept, so micro-batches can be as large.

        With tensor parallelism the vocabulary is sharded and the full-logits vocab-parallel
        path stays. Returns whether the chunked head is in use on this rank.
        """
        if self.parallel.tp_size != 1 or not self._is_last_stage:
            return False
        heads = [getattr(_unwrap(chunk), "output_layer", None) for chunk in self.model]
        heads = [head for head in heads if head is not None]
        if not heads or getattr(self.bridge.config, "mtp_num_layers", None):
            return False  # multi-token prediction reads real logits from the output layer
        for head in heads:
            head.forward = functools.partial(_pass_hidden_through, head, self._head_weights)
        return True

    def _transformer_overrides(self) -> dict[str, Any]:
        """TransformerConfig fields the engine sets on top of mbridge's mapping."""
        cfg, mcfg = self.config, self.config.megatron
        extra: dict[str, Any] = {
            # fused kernels that need Apex / Transformer Engine / compiled extensions
            "masked_softmax_fusion": False,
            "bias_activation_fusion": False,
            "bias_dropout_fusion": False,
            "apply_rope_fusion": False,
            "gradient_accumulation_fusion": False,
            "persist_layer_norm": False,
            # the local (non-Transformer-Engine) norms cannot split the sequence over TP
            "sequence_parallel": False,
            "deterministic_mode": mcfg.use_deterministic_algorithms,
            "moe_token_dispatcher_type": mcfg.moe_token_dispatcher_type,
            "moe_router_dtype": mcfg.moe_router_dtype,
            "moe_router_bias_update_rate": mcfg.moe_router_bias_update_rate,
            "moe_z_loss_coeff": mcfg.moe_z_loss_coeff,
            "moe_grouped_gemm": False,
        }
        if self.device.type == "cpu":
            extra["use_cpu_initialization"] = True
        if cfg.disable_dropout:
            extra.update(attention_dropout=0.0, hidden_dropout=0.0)
        if cfg.use_kernels:
            # Megatron's own fused SwiGLU / GeGLU and bias-dropout-add: torch.compile'd
            # functions (megatron.core.jit), no extension needed
            extra["bias_dropout_fusion"] = True
            extra["bias_activation_fusion"] = _fusable_activation(self.bridge.config)
        if cfg.gradient_checkpointing and mcfg.recompute_granularity:
            extra.update(
                recompute_granularity=mcfg.recompute_granularity,
                recompute_method=mcfg.recompute_method
                if mcfg.recompute_granularity == "full"
                else None,
                recompute_num_layers=mcfg.recompute_num_layers
                if mcfg.recompute_granularity == "full"
                else None,
            )
            if mcfg.recompute_modules:
                extra["recompute_modules"] = list(mcfg.recompute_modules)
        return extra

    def _build_optimizer(self) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        opt, cfg, mcfg = self.config.optimizer, self.config, self.config.megatron
        if opt.type not in ("adam", "sgd"):
            raise ValueError(
                f"optimizer.type {opt.type!r} is not supported by the Megatron engine; "
                "use adam or sgd"
            )
        if opt.type == "sgd" and mcfg.ddp.use_distributed_optimizer:
            raise ValueError(
                "optimizer.type sgd: Megatron's distributed optimizer supports Adam only; "
                "use adam or set megatron.ddp.use_distributed_optimizer: false"
            )
        dtype = to_dtype(cfg.dtype)
        self.optimizer = get_megatron_optimizer(
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
            self.model,
        )
        if cfg.use_kernels:
            _fuse_torch_adam(self.optimizer)
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.utils import get_model_config

        model_config = get_model_config(self.model[0])
        model_config.finalize_model_grads_func = finalize_model_grads
        model_config.grad_scale_func = self.optimizer.scale_loss
        no_sync = [chunk.no_sync for chunk in self.model]
        model_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync

    def _load_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        with contextlib.suppress(Exception):  # a weights-only directory is fine for training
            self.tokenizer = AutoTokenizer.from_pretrained(self.config.path)

    def destroy(self) -> None:
        from megatron.core import parallel_state

        self.model, self.optimizer, self.bridge = [], None, None
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        self._groups_ready = False
        if self._own_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_process_group = False

    def train(self, mode: bool = True) -> MegatronEngine:
        assert self.model, "initialize() the engine first"
        for chunk in self.model:
            chunk.train(mode)
        self._training = mode
        return self

    # --- forward ---

    def _micro_batches(self, input_: dict[str, Any]):
        batch = {
            k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input_.items()
        }
        # sequence parallelism splits every stream over the TP ranks
        multiple = math.lcm(64, self.parallel.tp_size)
        return split_padded_tensor_dict_into_mb_list(
            batch, self.config.mb_spec, group=self._cpu_group, pad_to_multiple=multiple
        )

    def _run_schedule(self, mbs: list[dict[str, Any]], loss_of, forward_only: bool) -> list:
        """Megatron's pipeline schedule over packed micro-batches.

        ``loss_of(mb, logp, entropy) -> (scaled_loss, report)`` runs on the last pipeline
        stage; returns the ``report`` dicts of the micro-batches there (empty elsewhere).
        """
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.pipeline_parallel import get_forward_backward_func

        temperature = float(self.config.temperature)
        tp_group = self._tp_group

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            cu = mb["cu_seqlens"].to(torch.int32)
            seqlen = int(mb["max_seqlen"])
            packed = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=seqlen,
                max_seqlen_kv=seqlen,
            )
            output = model(
                input_ids=mb["input_ids"],
                position_ids=mb["position_ids"],
                attention_mask=None,
                packed_seq_params=packed,
            )

            def loss_func(logits: torch.Tensor):
                labels = next_token_labels(mb["input_ids"][0], cu)
                if self._chunked_head:  # "logits" are the final hidden states [1, T, H]
                    weight = self._head_weights.pop()
                    hidden = logits[0]
                    if weight.dtype in (torch.bfloat16, torch.float16):
                        # Megatron's half-precision wrapper hands the last stage's output
                        # back as fp32; the values are 16-bit, so this cast is exact
                        hidden = hidden.to(weight.dtype)
                    logp, entropy = gather_logprobs(
                        hidden,
                        weight,
                        labels,
                        temperature=temperature,
                        chunk_size=self.config.logprobs_chunk_size,
                        fused=self.config.use_kernels,
                    )
                else:
                    logp, entropy = vocab_parallel_logprobs(
                        logits[0], labels, tp_group, temperature
                    )
                return loss_of(mb, logp, entropy)

            return output, loss_func

        n_chunks = len(self.model)
        iterators = [iter(mbs) for _ in range(n_chunks)]
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if n_chunks > 1 else iterators[0],
            model=self.model if n_chunks > 1 else self.model[0],
            num_microbatches=len(mbs),
            seq_length=max(int(mb["input_ids"].shape[-1]) for mb in mbs),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _broadcast_from_last_stage(self, tensor: torch.Tensor | None, shape, dtype):
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        tensor = tensor.to(self.device)
        dist.broadcast(
            tensor,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return tensor

    @torch.no_grad()
    def forward_batch(self, input_: dict[str, Any], **kwargs: Any) -> torch.Tensor:
        """Per-token log-probs ``[B, L]``: position ``t`` scores token ``t + 1`` (0 at the
        last real position and on padding); the same on every rank."""
        was_training = self._training
        self.train(False)
        try:
            mb_list = self._micro_batches(input_)
            reports = self._run_schedule(
                mb_list.mbs,
                lambda mb, logp, entropy: (logp.sum() * 0.0, {"logp": logp.detach()}),
                forward_only=True,
            )
            logp = None
            if self._is_last_stage:
                logp = mb_list.to_padded([r["logp"] for r in reports], pad_value=0.0)
                logp = logp.to(torch.float32)
            shape = tuple(input_["attention_mask"].shape)
            logp = self._broadcast_from_last_stage(logp, shape, torch.float32)
            return mask_last_tokens(logp, input_["attention_mask"])
        finally:
            self.train(was_training)

    # --- training ---

    def _global_weight(self, weights: list[float]) -> float:
        # every rank of a model-parallel group holds the same data: sum over all, divide
        total = torch.tensor([sum(weights)], dtype=torch.float64)
        dist.all_reduce(total, group=self._cpu_group)
        return float(total.item()) * self.data_parallel_world_size / dist.get_world_size()

    def _reported_sum(self, value: float) -> float:
        """Sum of ``value`` over the reporting ranks (one per DP replica), on every rank."""
        mine = value if dist.get_rank() in self._reporters else 0.0
        total = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(total, group=self._cpu_group)
        return float(total.item())

    def train_batch(
        self, input_: dict[str, Any], loss_fn: LossFn, loss_weight_fn: WeightFn
    ) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer (actor.optimizer is null)")
        self.train(True)
        mb_list = self._micro_batches(input_)
        weights = [float(loss_weight_fn(_flat(mb))) for mb in mb_list.mbs]
        total = self._global_weight(weights)
        self.optimizer_zero_grad()
        if total <= 0:
            logger.warning("train_batch: no trainable tokens in the global batch; step skipped")
            return {"update_successful": 0.0, "grad_norm": 0.0, "lr": self._lr(), "loss": 0.0}
        # the schedule divides each loss by the micro-batch count, DDP averages over DP
        factor = self.data_parallel_world_size * len(mb_list.mbs) / total
        weight_of = {id(mb): w for mb, w in zip(mb_list.mbs, weights, strict=True)}

        def loss_of(mb, logp, entropy):
            loss = loss_fn(logp, entropy, _flat(mb))
            weight = weight_of[id(mb)]
            return loss * (weight * factor), {"weighted": loss.detach() * (weight / total)}

        reports = self._run_schedule(mb_list.mbs, loss_of, forward_only=False)
        loss_sum = float(sum(float(r["weighted"]) for r in reports))
        stats = self.optimizer_step()
        return {
            **stats,
            "loss": self._reported_sum(loss_sum),
            "num_micro_batches": len(weights),
        }

    @torch.no_grad()
    def eval_batch(self, input_: dict[str, Any], loss_fn: LossFn, loss_weight_fn: WeightFn):
        was_training = self._training
        self.train(False)
        try:
            mb_list = self._micro_batches(input_)
            weights = [float(loss_weight_fn(_flat(mb))) for mb in mb_list.mbs]
            total = max(self._global_weight(weights), 1e-12)
            weight_of = {id(mb): w for mb, w in zip(mb_list.mbs, weights, strict=True)}

            def loss_of(mb, logp, entropy):
                loss = loss_fn(logp, entropy, _flat(mb))
                return loss.detach() * 0.0, {"weighted": loss.detach() * weight_of[id(mb)] / total}

            reports = self._run_schedule(mb_list.mbs, loss_of, forward_only=True)
            return self._reported_sum(float(sum(float(r["weighted"]) for r in reports)))
        finally:
            self.train(was_training)

    def optimizer_zero_grad(self) -> None:
        for chunk in self.model:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    def _apply_lr(self) -> None:
        lr = self.config.optimizer.lr * lr_multiplier(
            self._lr_step, self.config.optimizer, max(1, self._total_steps)
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def optimizer_step(self) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer (actor.optimizer is null)")
        found_inf = self.optimizer.prepare_grads()
        clip = self.config.optimizer.gradient_clipping
        # one norm computation: clipping returns the norm it clipped by (a non-finite
        # norm leaves nothing worth keeping: the step is skipped and the grads zeroed)
        if clip > 0:
            grad_norm = float(self.optimizer.clip_grad_norm(clip))
        else:
            grad_norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            self.optimizer_zero_grad()
            logger.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm)
            return {"update_successful": 0.0, "grad_norm": grad_norm, "lr": self._lr()}
        ok = self.optimizer.step_with_ready_grads()
        self.optimizer_zero_grad()
        self._optimizer_steps = getattr(self, "_optimizer_steps", 0) + 1
        return {
            "update_successful": float(bool(ok)),
            "grad_norm": grad_norm,
            "lr": self._lr(),
            "optimizer_steps": float(self._optimizer_steps),
        }

    def lr_scheduler_step(self) -> None:
        if self.optimizer is not None:
            self._lr_step += 1
            self._apply_lr()

    step_lr_scheduler = lr_scheduler_step

    # --- versions ---

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return self._version

    # --- HF export ---

    def _hf_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one at a time (a collective on every rank)."""
        for name, tensor in self.bridge.export_weights(self.model):
            yield name, tensor if dtype is None else tensor.to(dtype)

    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A copy of the whole model as an HF state dict on CPU, on every rank (collective)."""
        return {name: t.detach().to("cpu", copy=True) for name, t in self._hf_tensors(dtype)}

    def _save_hf(self, path: str, tokenizer: Any = None) -> None:
        from safetensors.torch import save_file
        from transformers import AutoConfig

        rank0 = dist.get_rank() == 0
        out = Path(path)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in self._hf_tensors(to_dtype(self.config.dtype)):
            if not rank0:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if size and size + nbytes > HF_SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = tensor.detach().cpu().contiguous()
            size += nbytes
        if rank0:
            out.mkdir(parents=True, exist_ok=True)
            n = len(shards)
            index: dict[str, str] = {}
            for i, shard in enumerate(shards):
                file = (
                    "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                )
                save_file(shard, str(out / file), metadata={"format": "pt"})
                index.update(dict.fromkeys(shard, file))
            if n > 1:
                (out / "model.safetensors.index.json").write_text(
                    json.dumps({"metadata": {}, "weight_map": index}, indent=2)
                )
            AutoConfig.from_pretrained(self.config.path).save_pretrained(out)
            with contextlib.suppress(Exception):
                from transformers import GenerationConfig

                GenerationConfig.from_pretrained(self.config.path).save_pretrained(out)
            tokenizer = tokenizer or self.tokenizer
            if tokenizer is not None:
                tokenizer.save_pretrained(out)
        dist.barrier(group=self._cpu_group)

    def _load_hf(self, path: str) -> None:
        self.bridge.load_weights(self.model, path)
        if self.optimizer is not None:  # main (fp32) params follow the new model params
            self.optimizer.reload_model_params()

    # --- distributed checkpoint (recover) ---

    def _sharded_state(self, with_optim: bool, is_loading: bool) -> dict[str, Any]:
        model_state: dict[str, Any] = {}
        for i, chunk in enumerate(self.model):
            key = "model" if len(self.model) == 1 else f"model{i}"
            model_state[key] = _unwrap(chunk).sharded_state_dict()
        state = dict(model_state)
        if with_optim and self.optimizer is not None:
            flat = {}
            for chunk_state in model_state.values():
                flat.update(chunk_state)
            # loading initializes empty optimizer state first, where the optimizer knows how
            # (Megatron has no state initializer for SGD, whose state may stay empty)
            parts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
            can_init = all(getattr(part, "init_state_fn", None) for part in parts)
            if is_loading and can_init:
                _init_optimizer_state(parts)
            # dp_reshardable: each rank saves and loads its own optimizer shard (recover keeps
            # the layout); megatron-core's default format needs ShardedTensor flattening,
            # which its torch_dist saver refuses ("flattened_range is not supported")
            state["optimizer"] = self.optimizer.sharded_state_dict(
                flat,
                is_loading=is_loading and can_init,
                metadata={"distrib_optim_sharding_type": "dp_reshardable"},
            )
        return state

    def _save_dcp(self, path: str, with_optim: bool) -> None:
        from megatron.core import dist_checkpointing

        Path(path).mkdir(parents=True, exist_ok=True)
        dist.barrier(group=self._cpu_group)
        dist_checkpointing.save(self._sharded_state(with_optim, is_loading=False), path)
        write_extra_state(
            path,
            version=self._version,
            lr_step=self._lr_step,
            optimizer_steps=getattr(self, "_optimizer_steps", 0),
        )
        dist.barrier(group=self._cpu_group)

    def _load_dcp(self, path: str, with_optim: bool) -> None:
        from megatron.core import dist_checkpointing

        with_optim = with_optim and self.optimizer is not None
        state = dist_checkpointing.load(self._sharded_state(with_optim, is_loading=True), path)
        # the optimizer copies loaded values into leaf parameters in place (no autograd)
        with torch.no_grad():
            for i, chunk in enumerate(self.model):
                key = "model" if len(self.model) == 1 else f"model{i}"
                _unwrap(chunk).load_state_dict(state[key])
            if with_optim:
                self.optimizer.load_state_dict(state["optimizer"])
            elif self.optimizer is not None:
                self.optimizer.reload_model_params()
        extra = read_extra_state(path)
        if extra is not None:
            self._version = extra.get("version", self._version)
            self._lr_step = extra.get("lr_step", self._lr_step)
            self._optimizer_steps = extra.get("optimizer_steps", 0)
            if self.optimizer is not None:
                self._apply_lr()
        dist.barrier(group=self._cpu_group)

    # --- weight sync ---

    def _weights_for_inference(self) -> Iterator[tuple[str, torch.Tensor]]:
        # every rank takes part in the bridge's TP/PP/EP gathers
        return self._hf_tensors(to_dtype(self.config.dtype))

    # --- housekeeping ---

    def export_stats(self) -> dict[str, float]:
        """Statistics reduced over the data-parallel replicas, the same on every rank.

        Loss statistics exist only on the last pipeline stage and repeat on every TP rank,
        so one rank per replica reduces them and the result is broadcast.
        """
        from areal.utils import stats_tracker

        if dist.get_rank() in self._reporters:
            stats = stats_tracker.export_all(reduce_group=self._reporter_group)
        else:
            stats_tracker.export_all()  # drop the duplicates
            stats = None
        box = [stats]
        dist.broadcast_object_list(box, src=self._reporters[0], group=self._cpu_group)
        return box[0]

    def get_device_stats(self) -> dict[str, float]:
        if self.device.type != "cuda":
            return {}
        return {
            "allocated_gb": torch.cuda.memory_allocated() / 2**30,
            "max_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
        }


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _init_optimizer_state(parts: list[Any]) -> None:
    """Give a fresh optimizer the state a checkpoint is loaded into.

    Megatron's initializer creates the Adam moments but not torch's per-parameter ``step``,
    which its distributed optimizer reads (without Apex/TE) when it builds the state dict.
    """
    for part in parts:
        inner = getattr(part, "optimizer", None)
        if inner is None:
            continue
        part.init_state_fn(inner, getattr(part, "config", None))
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.zeros((), dtype=torch.float32))
