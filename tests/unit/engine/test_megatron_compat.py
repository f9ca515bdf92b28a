"""The megatron-core / mbridge patches: each target still has the shape its patch relies on,
applying is idempotent, and another version is refused with a message naming it.

A failure in a ``*_target_*`` test after an upgrade means the patch in
:mod:`areal.engine.megatron_compat` must be ported (or dropped) before the pin moves.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from areal.engine import megatron_compat
from tests.unit.engine import megatron_cpu_shim

available, reason = megatron_cpu_shim.megatron_available()
needs_megatron = pytest.mark.skipif(not available, reason=reason)

ROOT = Path(__file__).resolve().parents[3]


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _source(obj) -> str:
    return re.sub(r"\s+", " ", inspect.getsource(obj))


def _qwen3_bridge(moe: bool = False, tied: bool = False):
    """A real mbridge bridge object without ``__init__`` (which needs Megatron's groups)."""
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import Qwen3Config, Qwen3MoeConfig

    shape = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied)  # fmt: skip
    if moe:
        cls, hf = _MODEL_REGISTRY["qwen3_moe"], Qwen3MoeConfig(**shape, num_experts=4)
    else:
        cls, hf = _MODEL_REGISTRY["qwen3"], Qwen3Config(**shape, intermediate_size=128)
    bridge = cls.__new__(cls)
    bridge.hf_config = hf
    return bridge


@pytest.fixture
def restore_globals(monkeypatch):
    """Put every process-wide patch target back after the test (and leave
    ``moe_utils.te_general_gemm`` undefined, as megatron-core does without TE)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.transformer import attention
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(attention, "apply_rotary_pos_emb", attention.apply_rotary_pos_emb)
    monkeypatch.setattr(clip_grads, "l2_norm_impl", clip_grads.l2_norm_impl)
    if not moe_utils.HAVE_TE:
        monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
        monkeypatch.delattr(moe_utils, "te_general_gemm")
    return monkeypatch


@pytest.fixture
def megatron_core_0_17(monkeypatch):
    """The version lookup answers megatron-core 0.17.0 (mbridge stays at its pin)."""
    found = {**megatron_compat.PINNED, "megatron-core": "0.17.0"}
    monkeypatch.setattr(megatron_compat, "_installed_version", found.__getitem__)


# --- the pins ---


def test_pins_are_the_megatron_extra_of_pyproject():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["megatron"]
    pinned = dict(req.split("==") for req in extra if "==" in req)
    assert {k: pinned[k] for k in megatron_compat.PINNED} == megatron_compat.PINNED


@needs_megatron
def test_the_installed_versions_are_the_pinned_ones():
    for package, version in megatron_compat.PINNED.items():
        assert megatron_compat._installed_version(package) == version


# --- each patch's target ---


@needs_megatron
def test_packed_rope_target_is_attention_s_module_level_rotary_function():
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention
    from megatron.core.transformer.transformer_config import TransformerConfig

    # attention calls the name through its module globals, with this signature
    assert "apply_rotary_pos_emb" in vars(attention)
    assert "apply_rotary_pos_emb(" in _source(attention.Attention.forward)
    assert _params(rope_utils.apply_rotary_pos_emb) == [
        "t", "freqs", "config", "cu_seqlens", "mscale", "cp_group"
    ]  # fmt: skip
    # the replacement rotates with Megatron's BSHD kernel and reads these config fields
    assert _params(rope_utils._apply_rotary_pos_emb_bshd)[:4] == [
        "t", "freqs", "rotary_interleaved", "multi_latent_attention"
    ]  # fmt: skip
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert {"apply_rope_fusion", "rotary_interleaved", "multi_latent_attention"} <= fields


@needs_megatron
def test_foreach_l2_norm_target_is_clip_grads_l2_norm_impl():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    assert "l2_norm_impl" in clip_grads.get_grad_norm_fp32.__code__.co_names
    assert _params(utils.local_multi_tensor_l2_norm) == [
        "chunk_size", "noop_flag", "tensor_lists", "per_tensor", "args"
    ]  # fmt: skip
    # without Apex the fallback is the local one (or already this patch's)
    assert clip_grads.l2_norm_impl in (
        utils.local_multi_tensor_l2_norm,
        megatron_compat._foreach_l2_norm,
    )


@needs_megatron
def test_moe_router_gemm_target_is_read_by_the_router_and_defined_only_with_te():
    from megatron.core.transformer.moe import moe_utils

    gating = moe_utils.RouterGatingLinearFunction
    assert "te_general_gemm" in gating.forward.__code__.co_names
    assert "te_general_gemm" in gating.backward.__code__.co_names
    assert "te_general_gemm is not None" in _source(gating.forward)
    if not moe_utils.HAVE_TE:
        assert getattr(moe_utils, "te_general_gemm", None) is None


@needs_megatron
def test_rope_theta_target_is_read_by_llm_bridge():
    from mbridge.core.llm_bridge import LLMBridge

    assert "self.hf_config.rope_theta" in _source(LLMBridge._get_gptmodel_args)


@needs_megatron
def test_local_norm_names_target_is_the_bridge_s_class_mappings():
    from mbridge.core.bridge import Bridge

    for name in ("_DIRECT_MAPPING", "_OTHER_MAPPING", "_MLP_MAPPING"):
        assert isinstance(getattr(Bridge, name), dict), name
    assert "output_layer.weight" in Bridge._DIRECT_MAPPING
    # the mappings are read through the instance, so instance copies take effect
    bridge = _qwen3_bridge(tied=True)
    megatron_compat.patch_bridge_local_norm_names(bridge)
    to_hf = bridge._weight_name_mapping_mcore_to_hf
    assert to_hf("decoder.layers.1.input_layernorm.weight") == [
        "model.layers.1.input_layernorm.weight"
    ]
    assert to_hf("decoder.layers.0.pre_mlp_layernorm.weight") == [
        "model.layers.0.post_attention_layernorm.weight"
    ]
    assert to_hf("output_layer.weight") == ["model.embed_tokens.weight"]  # tied
    assert type(bridge)._DIRECT_MAPPING["output_layer.weight"] == "lm_head.weight"  # unshared


@needs_megatron
def test_layer_spec_target_is_llm_bridge_s_spec_hook():
    from mbridge.core.llm_bridge import LLMBridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    assert _params(LLMBridge._get_transformer_layer_spec) == ["self", "vp_stage"]
    provider = _source(LLMBridge._model_provider)
    assert "self._get_transformer_layer_spec(vp_stage)" in provider
    assert "self.has_vp_stage" in provider
    params = _params(get_gpt_decoder_block_spec)
    assert params[:2] == ["config", "use_transformer_engine"] and "vp_stage" in params
    # the local spec swaps the core attention of each layer's self-attention
    assert "self_attention" in {f.name for f in dataclasses.fields(TransformerLayerSubmodules)}
    assert "core_attention" in {f.name for f in dataclasses.fields(SelfAttentionSubmodules)}


@needs_megatron
def test_expert_names_target_is_the_bridge_s_local_to_global_map():
    from mbridge.core.bridge import Bridge
    from mbridge.core.parallel_states import ParallelStates
    from megatron.core.transformer.moe.experts import SequentialMLP

    assert _params(Bridge._weight_name_mapping_mcore_local_to_global) == [
        "self", "model", "consider_ep"
    ]  # fmt: skip
    assert {"ep_size", "ep_rank"} <= {f.name for f in dataclasses.fields(ParallelStates)}
    assert "self.local_experts" in _source(SequentialMLP.__init__)
    # mbridge maps the grouped names the patch produces
    bridge = _qwen3_bridge(moe=True)
    megatron_compat.patch_bridge_local_norm_names(bridge)
    assert bridge._weight_name_mapping_mcore_to_hf(
        "decoder.layers.0.mlp.experts.linear_fc1.weight3"
    ) == [
        "model.layers.0.mlp.experts.3.gate_proj.weight",
        "model.layers.0.mlp.experts.3.up_proj.weight",
    ]


def test_grouped_expert_names_renumber_local_experts_globally():
    bridge = SimpleNamespace(
        config=SimpleNamespace(num_moe_experts=8), mpu=SimpleNamespace(ep_size=2, ep_rank=1)
    )

    def original(model, consider_ep=True):
        assert consider_ep is False
        return {
            "a": "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
            "b": "decoder.layers.0.self_attention.linear_qkv.weight",
        }

    names = megatron_compat._grouped_expert_names(bridge, original, model=None)
    # 4 experts per rank, rank 1: local expert 1 is global expert 1 + 4 * 1 = 5
    assert names["a"] == "decoder.layers.0.mlp.experts.linear_fc2.weight5"
    assert names["b"] == "decoder.layers.0.self_attention.linear_qkv.weight"
    local = megatron_compat._grouped_expert_names(bridge, original, None, consider_ep=False)
    assert local["a"] == "decoder.layers.0.mlp.experts.linear_fc2.weight1"


@needs_megatron
def test_output_layer_target_is_column_parallel_linear_called_with_weight():
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear

    assert _params(ColumnParallelLinear.forward) == [
        "self", "input_", "weight", "runtime_gather_output"
    ]  # fmt: skip
    assert re.search(
        r"self\.output_layer\( hidden_states, weight=output_weight, "
        r"runtime_gather_output=runtime_gather_output",
        _source(GPTModel),
    )


@needs_megatron
def test_output_layer_passes_its_input_through_and_keeps_the_weight():
    head = torch.nn.Linear(4, 6, bias=False)
    weights: list[torch.Tensor] = []
    assert megatron_compat.pass_hidden_through_output_layer(head, weights)
    hidden = torch.randn(3, 4)
    out, bias = head(hidden, weight=None, runtime_gather_output=None)
    assert out is hidden and bias is None and weights == [head.weight]
    tied = torch.randn(6, 4)
    head(hidden, weight=tied)
    assert weights[-1] is tied


# --- applying ---


@needs_megatron
def test_apply_patches_is_idempotent(restore_globals):
    from megatron.core.optimizer import clip_grads
    from megatron.core.transformer import attention
    from megatron.core.transformer.moe import moe_utils

    bridge = _qwen3_bridge(moe=True)
    megatron_compat.apply_patches(bridge)
    after_once = (
        attention.apply_rotary_pos_emb,
        clip_grads.l2_norm_impl,
        bridge._get_transformer_layer_spec,
        bridge._weight_name_mapping_mcore_local_to_global,
        dict(bridge._MLP_MAPPING),
        bridge.hf_config.rope_theta,
    )
    assert getattr(attention.apply_rotary_pos_emb, "_areal_packed", False)
    assert clip_grads.l2_norm_impl is megatron_compat._foreach_l2_norm
    assert bridge.has_vp_stage is True
    if not moe_utils.HAVE_TE:
        assert moe_utils.te_general_gemm is None
    megatron_compat.apply_patches(bridge)
    megatron_compat.apply_patches()
    # the expert-name wrapper alone is idempotent too: it wraps mbridge's method once
    megatron_compat.patch_bridge_expert_names(bridge)
    megatron_compat.patch_packed_rope()
    after_twice = (
        attention.apply_rotary_pos_emb,
        clip_grads.l2_norm_impl,
        bridge._get_transformer_layer_spec,
        bridge._weight_name_mapping_mcore_local_to_global,
        dict(bridge._MLP_MAPPING),
        bridge.hf_config.rope_theta,
    )
    assert all(a is b or a == b for a, b in zip(after_once, after_twice, strict=True))
    wrapper = bridge._weight_name_mapping_mcore_local_to_global
    assert wrapper.args[1].__func__ is type(bridge)._weight_name_mapping_mcore_local_to_global


@needs_megatron
def test_rope_theta_comes_from_rope_parameters():
    bridge = _qwen3_bridge()
    bridge.hf_config.rope_parameters = {"rope_theta": 5e5, "rope_type": "default"}
    if hasattr(bridge.hf_config, "rope_theta"):
        del bridge.hf_config.rope_theta
    megatron_compat.patch_bridge_rope_theta(bridge)
    assert bridge.hf_config.rope_theta == 5e5


# --- another version ---


def _refusal(package: str, found: str, symbol: str) -> str:
    pinned = megatron_compat.PINNED[package]
    return (
        f"cannot patch {symbol}: {package} {found} is installed, but the patch is written for "
        f"{package}=={pinned}"
    )


@needs_megatron
def test_a_required_patch_on_another_megatron_core_raises(megatron_core_0_17):
    from megatron.core.transformer.moe import moe_utils

    had = hasattr(moe_utils, "te_general_gemm")
    symbol = "megatron.core.transformer.moe.moe_utils.te_general_gemm"
    with pytest.raises(megatron_compat.MegatronVersionError) as error:
        megatron_compat.patch_moe_router_gemm()
    assert _refusal("megatron-core", "0.17.0", symbol) in str(error.value)
    assert hasattr(moe_utils, "te_general_gemm") == had  # nothing touched


@needs_megatron
def test_apply_patches_on_another_megatron_core_refuses_the_bridge(megatron_core_0_17):
    bridge = _qwen3_bridge()
    with pytest.raises(megatron_compat.MegatronVersionError, match=r"megatron-core 0\.17\.0"):
        megatron_compat.apply_patches(bridge)
    assert "_get_transformer_layer_spec" not in vars(bridge)
    assert not getattr(bridge, megatron_compat._BRIDGE_ADAPTED, False)


def test_a_bridge_patch_on_another_mbridge_raises_naming_mbridge(monkeypatch):
    found = {**megatron_compat.PINNED, "mbridge": "0.16.0"}
    monkeypatch.setattr(megatron_compat, "_installed_version", found.__getitem__)
    bridge = SimpleNamespace(hf_config=SimpleNamespace())
    symbol = "mbridge.core.bridge.Bridge._weight_name_mapping_mcore_local_to_global"
    with pytest.raises(megatron_compat.MegatronVersionError) as error:
        megatron_compat.patch_bridge_expert_names(bridge)
    assert _refusal("mbridge", "0.16.0", symbol) in str(error.value)
    assert vars(bridge) == {"hf_config": SimpleNamespace()}


@needs_megatron
def test_a_speed_only_patch_on_another_version_is_refused_out_loud(
    megatron_core_0_17, restore_globals, areal_logs
):
    from megatron.core.optimizer import clip_grads
    from megatron.core.transformer import attention

    rope, l2_norm = attention.apply_rotary_pos_emb, clip_grads.l2_norm_impl
    assert megatron_compat.patch_packed_rope() is False
    assert megatron_compat.patch_foreach_l2_norm() is False
    head = torch.nn.Linear(2, 2)
    assert megatron_compat.pass_hidden_through_output_layer(head, []) is False
    assert attention.apply_rotary_pos_emb is rope and clip_grads.l2_norm_impl is l2_norm
    assert "forward" not in vars(head)
    refused = [r.getMessage() for r in areal_logs.records if "patch refused" in r.getMessage()]
    assert len(refused) == 3
    assert (
        _refusal(
            "megatron-core", "0.17.0", "megatron.core.transformer.attention.apply_rotary_pos_emb"
        )
        in refused[0]
    )
