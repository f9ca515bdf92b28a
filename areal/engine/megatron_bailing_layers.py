"""Megatron modules for Ling 3's attention layers: KDA linear attention and gated MLA.

megatron-core has multi-latent attention (MLA) but neither KDA nor Ling's head-wise output
gate on MLA; both are here, built from Megatron's tensor-parallel linears so that tensor
parallelism splits them over heads like the rest of the model:

* :class:`KimiDeltaAttention`: q/k/v, forget-gate, beta and output-gate projections are
  column-parallel (each rank owns ``heads / t`` heads, with their short-convolution taps,
  ``A_log`` and ``dt_bias``), the output projection is row-parallel. The recurrence is
  :mod:`areal.engine.kda`, restarted at every packed segment; under context parallelism
  :mod:`areal.engine.kda_context_parallel` runs it over whole sequences for a share of the
  heads.
* :class:`GatedMLASelfAttention`: Megatron's ``MLASelfAttention`` with a column-parallel
  ``linear_gate`` (one sigmoid gate per head, from the layer input) applied to the
  attention output before ``linear_proj``. At ``t > 1`` (always sequence-parallel) its
  q / kv down projections are :class:`SequenceParallelLinear` s.
* :class:`SequenceParallelRMSNorm`: the RMS norm of every slot that sees sequence-sharded
  activations under sequence parallelism (layer norms, MLA latents), which Megatron's
  local ``WrappedTorchNorm`` refuses; :class:`SequenceShardedMoELayer` keeps the routed
  experts that TP ranks hold whole in step under sequence parallelism.

Both attention modules take the packed (THD) streams the engine builds; imported only where
megatron-core is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.utils import (
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from torch.nn import functional

from areal.engine.kda import gated_rms_norm, kda_delta_rule, kda_forget_gate, packed_causal_conv1d
from areal.engine.kda_context_parallel import context_parallel_kda

# the field of the engine's PackedSeqParams carrying the rank's context-parallel share
CP_KWARG_FIELD = "context_shard"

__all__ = [
    "GatedMLASelfAttention",
    "KDAShape",
    "KimiDeltaAttention",
    "LatentRMSNorm",
    "SequenceParallelLinear",
    "SequenceParallelRMSNorm",
    "SequenceShardedMoELayer",
]

# Ling 3 normalises the MLA latents with transformers' RMSNorm default, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class KDAShape:
    """What a KDA layer needs beyond Megatron's ``TransformerConfig``."""

    num_heads: int
    """Heads of the whole layer (split over tensor-parallel ranks)."""
    head_dim: int
    """Key and value width per head."""
    conv_kernel: int
    """Taps of the short causal convolution over q, k and v."""
    safe_gate: bool
    """Bounded forget gate ``lower_bound * sigmoid(.)`` instead of ``-softplus(.)``."""
    lower_bound: float
    """Lower bound of the safe gate's log decay per token, in ``[-5, 0)``."""
    norm_eps: float
    """Epsilon of the gated output RMS norm."""


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built like Megatron's norms (``config, hidden_size, eps``) that
    also works under sequence parallelism.

    With ``config.sequence_parallel`` each tensor-parallel rank normalises its own slice of
    the tokens, so its weight gradient is partial: the weight is marked ``sequence_parallel``
    and Megatron's ``finalize_model_grads`` sums it over the TP group. Use it only where the
    input is sequence-sharded (not after a column-parallel linear, which gathers the tokens).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        del unused  # persist_layer_norm, zero_centered_gamma, normalization: RMSNorm only
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


class LatentRMSNorm(SequenceParallelRMSNorm):
    """RMS norm over an MLA latent with :data:`LATENT_NORM_EPS` (the ``eps`` Megatron passes,
    its ``layernorm_epsilon``, is ignored). MLA scatters the down-projected latents back to
    sequence shards under sequence parallelism, so the weight is marked like a layer norm's."""

    def __init__(self, config, hidden_size: int, eps: float | None = None, **unused):
        del eps, unused
        super().__init__(config, hidden_size, eps=LATENT_NORM_EPS)


class SequenceParallelLinear(torch.nn.Module):
    """A bias-free linear replicated on every tensor-parallel rank, applied to that rank's
    sequence shard: MLA's q / kv down projections under sequence parallelism.

    Megatron's column-parallel down projection gathers the rotary key slice ``k_pos_emb``
    from column shards, and that gather's backward keeps each rank's partial gradient (its
    local heads only); with this linear MLA gathers ``k_pos_emb`` over the sequence instead,
    whose backward sums the heads' gradients. The weight's own gradient comes from local
    tokens only, so it is marked ``sequence_parallel`` (summed over the TP group).
    ``forward(x [T / t, 1, in]) -> (x W^T, None)``.
    """

    def __init__(self, config, input_size: int, output_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype)
        )
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.weight)
        self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return functional.linear(x, self.weight), None


class SequenceShardedMoELayer(MoELayer):
    """Megatron's MoE layer whose routed experts also sum their gradients over the
    tensor-parallel ranks that hold them whole.

    With sequence parallelism and expert tensor parallelism 1 under ``t > 1``, each TP rank
    runs its own tokens through a whole copy of its experts. Without expert parallelism
    Megatron files the experts with the dense parameters, whose gradients are reduced over
    data parallelism only, and the copies drift apart; marked ``allreduce = False`` they are
    reduced over the expert data-parallel group, which spans those TP ranks.
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        super().__init__(config, submodules, layer_number=layer_number,
                         pg_collection=pg_collection)  # fmt: skip
        expert_tp = getattr(pg_collection, "expt_tp", None)
        expert_tp_size = (
            expert_tp.size()
            if expert_tp is not None
            else parallel_state.get_expert_tensor_parallel_world_size()
        )
        if config.sequence_parallel and expert_tp_size != self.tp_group.size():
            for param in self.experts.parameters():
                param.allreduce = False


class KDAOutputNorm(torch.nn.Module):
    """RMS norm over each head's output, gated by ``sigmoid(gate)``; ``weight`` ``[head_dim]``
    is shared by all heads (replicated over tensor-parallel ranks, whose local heads each
    give part of its gradient: the backward sums it over ``tp_group``)."""

    def __init__(self, head_dim: int, eps: float, dtype: torch.dtype, tp_group=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(head_dim, dtype=dtype))
        self.eps = eps
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.tp_group is not None and self.tp_group.size() > 1:
            weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight, self.tp_group)
        return gated_rms_norm(x, gate, weight, self.eps)


class KimiDeltaAttention(MegatronModule):
    """KDA token mixer of a Ling 3 linear-attention layer (Megatron's self-attention slot).

    ``forward(hidden_states [T, 1, H], packed_seq_params)`` returns ``(out [T, 1, H], None)``;
    the recurrence restarts at every ``cu_seqlens`` boundary.
    """

    # own parameters split over tensor-parallel ranks along dim 0 (heads); like the
    # checkpoint (and transformers), they stay float32 in a 16-bit model
    OWN_PARAMETERS = ("q_conv1d", "k_conv1d", "v_conv1d", "A_log", "dt_bias")

    def __init__(self, config, layer_number: int, shape: KDAShape, pg_collection=None, **unused):
        super().__init__(config=config)
        del unused  # attn_mask_type, cp_comm_type: KDA is causal; CP swaps tokens for heads
        self.tp_group = (
            pg_collection.tp
            if pg_collection is not None
            else parallel_state.get_tensor_model_parallel_group()
        )
        tp = self.tp_group.size()
        if shape.num_heads % tp:
            raise ValueError(
                f"KDA has {shape.num_heads} heads, which tensor parallelism t{tp} cannot split "
                "evenly; choose t dividing the head count"
            )
        self.layer_number = layer_number
        self.shape = shape
        self.local_heads = shape.num_heads // tp
        width = shape.num_heads * shape.head_dim
        local_width = self.local_heads * shape.head_dim

        def column(out_features: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                config.hidden_size, out_features, config=config, init_method=config.init_method,
                bias=False, gather_output=False, skip_bias_add=True, tp_group=self.tp_group,
            )  # fmt: skip

        self.linear_q, self.linear_k, self.linear_v = column(width), column(width), column(width)
        self.linear_f = column(width)  # forget-gate input
        self.linear_beta = column(shape.num_heads)
        self.linear_gate = column(width)  # output gate
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            self.register_parameter(
                name, torch.nn.Parameter(torch.empty(local_width, 1, shape.conv_kernel))
            )
        self.A_log = torch.nn.Parameter(torch.empty(self.local_heads))
        self.dt_bias = torch.nn.Parameter(torch.empty(local_width))
        for name in self.OWN_PARAMETERS:
            tensor_parallel.set_tensor_model_parallel_attributes(getattr(self, name), True, 0, 1)
        self.o_norm = KDAOutputNorm(
            shape.head_dim, shape.norm_eps, config.params_dtype, tp_group=self.tp_group
        )
        self.linear_proj = RowParallelLinear(
            width, config.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group,
        )  # fmt: skip
        if config.perform_initialization:
            self._init_own_parameters()

    def _apply(self, fn, recurse=True):
        # Megatron's 16-bit wrapper casts the whole model (module.bfloat16()); the decay
        # and convolution parameters go back to float32 afterwards
        super()._apply(fn, recurse)
        for name in self.OWN_PARAMETERS:
            param = getattr(self, name)
            if param.dtype != torch.float32:
                param.data = param.data.float()
        return self

    @torch.no_grad()
    def _init_own_parameters(self) -> None:
        # decay rates A in [1, 16]; dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1]
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.empty_like(self.dt_bias)
        dt = dt.uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        bound = 1.0 / math.sqrt(self.shape.conv_kernel)  # nn.Conv1d's default for groups=C
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            getattr(self, name).uniform_(-bound, bound)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None,
                **unused):  # fmt: skip
        del attention_mask, unused  # causal by construction; no rotary embedding, no cache
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("KDA takes packed THD streams ([T, 1, H] with cu_seqlens)")
        cu_seqlens = packed_seq_params.cu_seqlens_q
        # x stays [T, 1, H] (Megatron's linears expect 3-D activations), or [T / t, 1, H]
        # under sequence parallelism: the column-parallel linears gather all T tokens
        x = hidden_states
        heads, dim = self.local_heads, self.shape.head_dim

        qkv = torch.cat([self.linear_q(x)[0], self.linear_k(x)[0], self.linear_v(x)[0]], dim=-1)
        tokens = qkv.shape[0]
        qkv = qkv.view(tokens, -1)
        decay = kda_forget_gate(
            self.linear_f(x)[0].view(tokens, heads, dim),
            self.A_log,
            self.dt_bias.view(heads, dim),
            self.shape.safe_gate,
            self.shape.lower_bound,
        )
        beta = torch.sigmoid(self.linear_beta(x)[0].float()).view(tokens, heads)
        shard = getattr(packed_seq_params, CP_KWARG_FIELD, None)
        if shard is not None and shard.size > 1:
            # this rank's tokens: the recurrence runs over whole sequences for a share of
            # the heads (an all-to-all each way)
            q, k, v = (t.reshape(tokens, heads, dim) for t in qkv.chunk(3, dim=-1))
            conv = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            mixed = context_parallel_kda(q, k, v, conv, decay, beta, shard)  # float32 q, k, v
        else:
            kernel = torch.cat([self.q_conv1d, self.k_conv1d, self.v_conv1d], dim=0)
            qkv = functional.silu(packed_causal_conv1d(qkv, kernel, cu_seqlens))
            q, k, v = (t.reshape(tokens, heads, dim) for t in qkv.chunk(3, dim=-1))
            mixed = kda_delta_rule(q, k, v, decay, beta, cu_seqlens)  # [T, heads, dim]
        gate = self.linear_gate(x)[0].view(tokens, heads, dim)
        out = self.o_norm(mixed, gate).reshape(tokens, 1, heads * dim)
        return self.linear_proj(out)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Distributed-checkpoint entries: the own parameters sharded by head like the
        linears, the output norm replicated."""
        own: dict = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        state = make_sharded_tensors_for_checkpoint(
            own,
            prefix,
            dict.fromkeys(self.OWN_PARAMETERS, 0),
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        )
        for name, child in self.named_children():
            state.update(
                sharded_state_dict_default(
                    child, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group
                )
            )
        return state


class GatedMLASelfAttention(MLASelfAttention):
    """Megatron's MLA with Ling 3's head-wise output gate, for packed training streams.

    ``out_h = sigmoid(linear_gate(x))_h * attention_h`` before ``linear_proj``. Inference
    caches are not supported (the engine trains and scores packed streams only).
    """

    def __init__(
        self,
        config,
        submodules,
        layer_number: int,
        attn_mask_type=AttnMaskType.causal,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        self.linear_gate = ColumnParallelLinear(
            config.hidden_size, config.num_attention_heads, config=config,
            init_method=config.init_method, bias=False, gather_output=False, skip_bias_add=True,
            tp_group=self.pg_collection.tp,
        )  # fmt: skip
        if self.pg_collection.tp.size() > 1:
            if not config.sequence_parallel:
                raise ValueError("gated MLA at t > 1 needs sequence parallelism")
            # replicated down projections over sequence shards (see SequenceParallelLinear)
            kv_width = config.kv_lora_rank + config.qk_pos_emb_head_dim
            self.linear_kv_down_proj = SequenceParallelLinear(config, config.hidden_size, kv_width)
            if config.q_lora_rank is not None:
                self.linear_q_down_proj = SequenceParallelLinear(
                    config, config.hidden_size, config.q_lora_rank
                )

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                rotary_pos_cos_sin=None, attention_bias=None, packed_seq_params=None,
                position_ids=None, sequence_len_offset=None, *, inference_params=None):  # fmt: skip
        del rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, sequence_len_offset
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("gated MLA has no inference-cache path")
        if key_value_states is not None or attention_bias is not None:
            raise ValueError("gated MLA is self-attention without attention bias")
        query, key, value, _, _ = self.get_query_key_value_tensors(
            hidden_states, None, position_ids, packed_seq_params
        )
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        if self.checkpoint_core_attention and self.training:
            out = self._checkpointed_attention_forward(
                query, key, value, attention_mask, packed_seq_params=packed_seq_params
            )
        else:
            out = self.core_attention(
                query, key, value, attention_mask,
                packed_seq_params=packed_seq_params, attn_mask_type=self.attn_mask_type,
            )  # fmt: skip
        gate = torch.sigmoid(self.linear_gate(hidden_states)[0].float()).to(out.dtype)
        # out: [T, heads, v] (THD) or [S, B, heads * v]; gate: [T, 1, heads] or [S, B, heads]
        out = out.reshape(*gate.shape, -1) * gate.unsqueeze(-1)
        out = out.reshape(*gate.shape[:-1], -1)
        if self.recompute_up_proj:
            self.qkv_up_checkpoint.discard_output_and_register_recompute(out)
            self.qkv_up_checkpoint = None
        return self.linear_proj(out)
