"""mbridge bridge for Ling 3 (``BailingMoeV3ForCausalLM``, transformers' ``bailing_hybrid``).

mbridge 0.15.1 knows no Bailing model; this module registers one under the config's
``model_type`` (``bailing_hybrid``, and the ``bailing_moe_v3`` alias of
:mod:`areal.models.bailing`), so ``mbridge.AutoBridge`` picks it up once imported (the
Megatron engine imports it before building a bridge).

* Config: Megatron's ``MLATransformerConfig`` (MLA dims, RoPE base) plus the MoE router
  Ling uses: sigmoid scores, an expert bias that only steers selection, groups ranked by
  the sum of their two best scores, renormalised top-k weights times
  ``routed_scaling_factor``, shared experts, dense MLPs where ``mlp_layer_types`` says so
  (``first_k_dense_replace``). MTP layers stay off.
* Layers (:meth:`BailingHybridBridge.local_layer_spec`): per ``layer_types`` entry a
  :class:`~areal.engine.megatron_bailing_layers.KimiDeltaAttention` or a
  :class:`~areal.engine.megatron_bailing_layers.GatedMLASelfAttention` with the engine's
  packed causal attention, each followed by a dense MLP or an MoE; all Megatron local
  (non Transformer Engine) modules, with norms of our own that allow sequence parallelism.
* Tensor parallelism: Megatron trains MoE layers under it only with sequence parallelism,
  so at ``t > 1`` the model always runs sequence-parallel (``sequence_parallel_with_tp``).
* Names: Megatron parameters map to the names Ling 3 checkpoints store (``model.word_
  embeddings``, ``layers.N.attention.*``, per-expert ``mlp.experts.E.*``, ``mlp.gate.
  expert_bias``); transformers renames them on load and back on ``save_pretrained``, so HF
  export and weight sync speak the checkpoint's own names.

Settings the Megatron port does not reproduce are refused when the bridge is built, naming
the config field.
"""

from __future__ import annotations

import re

from mbridge.core import LLMBridge, register_model
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import MLATransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from areal.engine.megatron_bailing_layers import (
    GatedMLASelfAttention,
    KDAShape,
    KimiDeltaAttention,
    LatentRMSNorm,
    SequenceParallelRMSNorm,
    SequenceShardedMoELayer,
)
from areal.engine.megatron_model import packed_core_attention_class
from areal.models import bailing  # registers the bailing_moe_v3 alias with transformers

__all__ = ["BailingHybridBridge", "unsupported_settings"]

# Megatron name inside decoder.layers.N -> checkpoint names inside model.layers.N; the KDA
# and MLA layers share the ``attention.`` names of their common parts (gate, dense)
_LAYER_NAMES: dict[str, list[str]] = {
    "input_layernorm.weight": ["input_layernorm.weight"],
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    # KDA
    "self_attention.linear_q.weight": ["attention.q_proj.weight"],
    "self_attention.linear_k.weight": ["attention.k_proj.weight"],
    "self_attention.linear_v.weight": ["attention.v_proj.weight"],
    "self_attention.q_conv1d": ["attention.q_conv1d.weight"],
    "self_attention.k_conv1d": ["attention.k_conv1d.weight"],
    "self_attention.v_conv1d": ["attention.v_conv1d.weight"],
    "self_attention.linear_f.weight": ["attention.f_proj.weight"],
    "self_attention.A_log": ["attention.A_log"],
    "self_attention.dt_bias": ["attention.dt_bias"],
    "self_attention.linear_beta.weight": ["attention.b_proj.weight"],
    "self_attention.o_norm.weight": ["attention.o_norm.weight"],
    # MLA
    "self_attention.linear_q_proj.weight": ["attention.q_proj.weight"],
    "self_attention.linear_q_down_proj.weight": ["attention.q_a_proj.weight"],
    "self_attention.q_layernorm.weight": ["attention.q_a_layernorm.weight"],
    "self_attention.linear_q_up_proj.weight": ["attention.q_b_proj.weight"],
    "self_attention.linear_kv_down_proj.weight": ["attention.kv_a_proj_with_mqa.weight"],
    "self_attention.kv_layernorm.weight": ["attention.kv_a_layernorm.weight"],
    "self_attention.linear_kv_up_proj.weight": ["attention.kv_b_proj.weight"],
    # both
    "self_attention.linear_gate.weight": ["attention.g_proj.weight"],
    "self_attention.linear_proj.weight": ["attention.dense.weight"],
    # dense MLP
    "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
    # MoE
    "mlp.router.weight": ["mlp.gate.weight"],
    "mlp.router.expert_bias": ["mlp.gate.expert_bias"],
    "mlp.shared_experts.linear_fc1.weight": [
        "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight",
    ],
    "mlp.shared_experts.linear_fc2.weight": ["mlp.shared_experts.down_proj.weight"],
}
_TOP_NAMES = {
    "embedding.word_embeddings.weight": "model.word_embeddings.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
# grouped expert names (areal.engine.megatron_compat names local experts this way)
_EXPERT = re.compile(r"mlp\.experts\.linear_fc([12])\.weight(\d+)$")


def unsupported_settings(hf_config) -> list[str]:
    """Why this checkpoint's config cannot be reproduced by the Megatron port (empty: it can).

    Each entry names the config field and what the port would compute instead.
    """
    problems = []
    limits = [*(hf_config.swiglu_limits or []), *(hf_config.swiglu_limits_shared or [])]
    if any(limit for limit in limits):
        problems.append(
            "expert_swiglu_limit_list / share_expert_swiglu_limit_list: clipping after the "
            "activation is not implemented in the Megatron MLP (all limits must be 0)"
        )
    rope = dict(hf_config.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.rope_type {rope.get('rope_type')!r}: only 'default'")
    if not hf_config.norm_topk_prob and hf_config.num_experts_per_tok > 1:
        problems.append("norm_topk_prob false: Megatron renormalises the top-k sigmoid weights")
    n_group, topk_group = hf_config.n_group or 1, hf_config.topk_group or 1
    if n_group > 1 and hf_config.num_experts_per_tok // topk_group != 2:
        problems.append(
            f"num_experts_per_tok {hf_config.num_experts_per_tok} / topk_group {topk_group}: "
            "Megatron ranks a group by its top (num_experts_per_tok // topk_group) scores and "
            "Ling by its top 2, so the quotient must be 2"
        )
    if getattr(hf_config, "attention_bias", False):
        problems.append("attention_bias true: the port's MLA has no projection biases")
    if getattr(hf_config, "tie_word_embeddings", False):
        problems.append("tie_word_embeddings true: Ling 3 has an untied LM head")
    return problems


@register_model([bailing.MODEL_TYPE, bailing.ALIAS_MODEL_TYPE])
class BailingHybridBridge(LLMBridge):
    """Ling 3 on megatron-core: KDA / gated-MLA hybrid layers, grouped-router MoE."""

    TransformerConfigClass = MLATransformerConfig
    # at t > 1 the model runs sequence-parallel (Megatron's MoE needs it), which the norms and
    # MLA down projections of local_layer_spec support
    sequence_parallel_with_tp = True

    def _build_config(self):
        hf = self.hf_config
        problems = unsupported_settings(hf)
        if problems:
            raise ValueError(
                "this Ling 3 checkpoint uses settings the Megatron engine does not reproduce:\n  "
                + "\n  ".join(problems)
            )
        rope_theta = float((hf.rope_parameters or {}).get("rope_theta", hf.rope_theta))
        return self._build_base_config(
            layernorm_epsilon=hf.rms_norm_eps,
            ffn_hidden_size=hf.intermediate_size,
            # MLA (full-attention layers)
            multi_latent_attention=True,
            q_lora_rank=hf.q_lora_rank,
            kv_lora_rank=hf.kv_lora_rank,
            qk_head_dim=hf.qk_nope_head_dim,
            qk_pos_emb_head_dim=hf.qk_rope_head_dim,
            v_head_dim=hf.v_head_dim,
            kv_channels=hf.qk_nope_head_dim + hf.qk_rope_head_dim,
            rope_type="rope",
            rotary_base=rope_theta,
            rotary_scaling_factor=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            # MoE
            num_moe_experts=hf.num_local_experts,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_shared_expert_intermediate_size=hf.moe_intermediate_size * hf.n_shared_experts,
            moe_shared_expert_overlap=False,
            moe_router_topk=hf.num_experts_per_tok,
            moe_router_num_groups=hf.n_group if (hf.n_group or 1) > 1 else None,
            moe_router_group_topk=hf.topk_group if (hf.n_group or 1) > 1 else None,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=hf.routed_scaling_factor,
            moe_router_pre_softmax=False,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_layer_freq=[1 if kind == "sparse" else 0 for kind in hf.mlp_layer_types],
            moe_grouped_gemm=False,
        )

    def _get_gptmodel_args(self) -> dict:
        hf = self.hf_config
        rope_theta = float((hf.rope_parameters or {}).get("rope_theta", hf.rope_theta))
        return {
            "vocab_size": hf.vocab_size,
            "max_sequence_length": hf.max_position_embeddings,
            "position_embedding_type": "rope",  # MLA builds its own rotary embedding
            "rotary_base": rope_theta,
        }

    # --- layers ---

    def _kda_shape(self) -> KDAShape:
        hf = self.hf_config
        return KDAShape(
            num_heads=getattr(hf, "linear_num_heads", hf.num_attention_heads),
            head_dim=getattr(hf, "linear_head_dim", hf.head_dim),
            conv_kernel=getattr(hf, "linear_conv_kernel_dim", hf.short_conv_kernel_size),
            safe_gate=bool(hf.kda_safe_gate),
            lower_bound=float(hf.kda_lower_bound),
            norm_eps=float(hf.rms_norm_eps),
        )

    def local_layer_spec(self, vp_stage: int | None = None) -> TransformerBlockSubmodules:
        """This pipeline stage's decoder layers: KDA or gated MLA per ``layer_types``, dense
        MLP or MoE per ``mlp_layer_types``, from Megatron's local modules."""
        backend = LocalSpecProvider()
        norm = SequenceParallelRMSNorm  # layer and final norms: sequence-sharded under SP
        kda = ModuleSpec(module=KimiDeltaAttention, params={"shape": self._kda_shape()})
        mla = ModuleSpec(
            module=GatedMLASelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=ColumnParallelLinear,
                linear_q_down_proj=ColumnParallelLinear,
                linear_q_up_proj=ColumnParallelLinear,
                linear_kv_down_proj=ColumnParallelLinear,
                linear_kv_up_proj=ColumnParallelLinear,
                core_attention=packed_core_attention_class(),
                linear_proj=RowParallelLinear,
                q_layernorm=LatentRMSNorm,
                kv_layernorm=LatentRMSNorm,
            ),
        )
        dense = get_mlp_module_spec_for_backend(backend, num_experts=None)
        moe = get_mlp_module_spec_for_backend(
            backend, num_experts=self.config.num_moe_experts, moe_grouped_gemm=False
        )
        moe.module = SequenceShardedMoELayer
        attention_kinds = self.hf_config.layer_types[: self.config.num_layers]
        mlp_kinds = self.hf_config.mlp_layer_types[: self.config.num_layers]
        layers = [
            ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=norm,
                    self_attention=kda if attention == "linear_attention" else mla,
                    self_attn_bda=get_bias_dropout_add,
                    pre_mlp_layernorm=norm,
                    mlp=moe if mlp == "sparse" else dense,
                    mlp_bda=get_bias_dropout_add,
                ),
            )
            for attention, mlp in zip(attention_kinds, mlp_kinds, strict=True)
        ]
        offset = get_transformer_layer_offset(self.config, vp_stage=vp_stage)
        count = get_num_layers_to_build(self.config, vp_stage=vp_stage)
        return TransformerBlockSubmodules(layer_specs=layers[offset : offset + count],
                                          layer_norm=norm)  # fmt: skip

    def _get_transformer_layer_spec(self, vp_stage: int | None = None):
        self.has_vp_stage = True
        return self.local_layer_spec(vp_stage)

    # --- tensor-parallel layout of local experts ---

    def _experts_whole_on_tp_ranks(self, mcore_weights_name: str) -> bool:
        """Whether ``mcore_weights_name`` is an expert weight that every tensor-parallel rank
        holds whole (experts split over ``etp`` ranks, here 1, not over ``t``).

        mbridge splits and gathers local (``SequentialMLP``) expert weights over the ``t``
        ranks; with ``etp`` 1 each of them must get or give the whole tensor. ``etp`` other
        than 1 or ``t`` is refused.
        """
        is_expert = ".mlp.experts.local_experts." in mcore_weights_name or (
            ".mlp.experts.linear_fc" in mcore_weights_name
        )
        if not is_expert or self.mpu.etp_size == self.mpu.tp_size:
            return False
        if self.mpu.etp_size != 1:
            raise NotImplementedError(
                f"expert tensor parallelism {self.mpu.etp_size} with t{self.mpu.tp_size}: "
                "use expert t1 or the same t as attention"
            )
        return True

    def _weight_split_across_tp(self, mcore_weights_name, mcore_weights, param, tp_split_size):
        if self._experts_whole_on_tp_ranks(mcore_weights_name):
            return [mcore_weights] * tp_split_size
        return super()._weight_split_across_tp(
            mcore_weights_name, mcore_weights, param, tp_split_size
        )

    def _weight_merge_across_tp(self, mcore_weights_name, mcore_weights, param):
        if self._experts_whole_on_tp_ranks(mcore_weights_name):
            return mcore_weights[0]  # the t ranks' copies are the same tensor
        return super()._weight_merge_across_tp(mcore_weights_name, mcore_weights, param)

    def _weight_to_mcore_format(self, mcore_weights_name, hf_weights):
        # mbridge casts what it loads to the compute dtype; KDA's float32 parameters
        # (KimiDeltaAttention.OWN_PARAMETERS) take the checkpoint's float32 values unrounded
        if mcore_weights_name.rsplit(".", 1)[-1] in KimiDeltaAttention.OWN_PARAMETERS:
            return hf_weights[0]
        return super()._weight_to_mcore_format(mcore_weights_name, hf_weights)

    # --- names ---

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        """Checkpoint names of one global Megatron parameter (2 for fused gate/up)."""
        if mcore_weights_name in _TOP_NAMES:
            return [_TOP_NAMES[mcore_weights_name]]
        match = _LAYER.match(mcore_weights_name)
        if match is None:
            raise NotImplementedError(f"no Ling 3 checkpoint name for {mcore_weights_name}")
        layer, rest = match.groups()
        prefix = f"model.layers.{layer}."
        expert = _EXPERT.match(rest)
        if expert is not None:
            fc, index = expert.groups()
            projections = ["gate_proj", "up_proj"] if fc == "1" else ["down_proj"]
            return [f"{prefix}mlp.experts.{index}.{p}.weight" for p in projections]
        if rest not in _LAYER_NAMES:
            raise NotImplementedError(f"no Ling 3 checkpoint name for {mcore_weights_name}")
        return [prefix + name for name in _LAYER_NAMES[rest]]
