"""Ling 3 (``BailingMoeV3ForCausalLM``) checkpoints on transformers' ``bailing_hybrid`` model.

Ling 3 interleaves KDA linear-attention layers with MLA softmax-attention layers and routes
tokens through grouped-router MoE blocks with shared experts. transformers (5.25 and later)
implements it as ``bailing_hybrid``. Real checkpoints say ``"model_type": "bailing_hybrid"``
and ``"architectures": ["BailingMoeV3ForCausalLM"]``, so the auto classes already resolve
them by model type; :func:`register` adds ``bailing_moe_v3`` as an alias model type (for
configs that use the architecture's own name) with the same classes and weight conversion.

Checkpoints store the official weight names; the transformers model uses its own names and
fuses some tensors. transformers converts on load and reverts on ``save_pretrained``; weight
updates and exports need the same conversion one tensor at a time, which this module does:

====================================================  ============================================
official (checkpoint, SGLang)                         internal (``state_dict`` of the HF model)
====================================================  ============================================
``model.word_embeddings.weight``                      ``model.embed_tokens.weight``
``layers.N.attention.*``                              ``layers.N.self_attn.*``
``attention.{q,k,v}_conv1d.weight`` ``[C, 1, K]``     ``self_attn.conv1d.weight`` ``[3C, 1, K]``
``attention.{f_proj.weight,dt_bias,A_log}``           ``self_attn.forget_gate.{...}``
``attention.dense.weight``                            ``self_attn.o_proj.weight``
``mlp.experts.E.{gate,up}_proj.weight`` ``[I, H]``    ``mlp.experts.gate_up_proj`` ``[n, 2I, H]``
``mlp.experts.E.down_proj.weight`` ``[H, I]``         ``mlp.experts.down_proj`` ``[n, H, I]``
``mlp.gate.expert_bias``                              ``mlp.gate.e_score_correction_bias``
====================================================  ============================================

Everything else (norms, the router weight, shared experts, dense MLPs, ``lm_head``) keeps
its name. ``save_pretrained`` also writes the config in transformers' spelling (its own
architecture, ``head_dim`` meaning the rotary part, ``num_expert_group``...);
:func:`write_official_config` puts back the official one.

Packed-sequence training of the KDA layers lives in :mod:`areal.models.bailing_packed`.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ALIAS_MODEL_TYPE",
    "MODEL_TYPE",
    "OFFICIAL_ARCHITECTURE",
    "HFStateAssembler",
    "is_bailing_config",
    "register",
    "to_hf_state_dict",
    "to_official",
    "to_official_state_dict",
    "write_official_config",
]

MODEL_TYPE = "bailing_hybrid"
ALIAS_MODEL_TYPE = "bailing_moe_v3"
OFFICIAL_ARCHITECTURE = "BailingMoeV3ForCausalLM"

# --- internal -> official ---

# Applied in order to every name; the forget-gate and o_proj renames must precede the
# generic ``self_attn`` -> ``attention`` one.
_TO_OFFICIAL = [
    (re.compile(r"^model\.embed_tokens\."), "model.word_embeddings."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
    (re.compile(r"\.self_attn\.o_proj\."), ".self_attn.dense."),
    (re.compile(r"\.self_attn\."), ".attention."),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.gate.expert_bias"),
]
_FUSED_CONV = re.compile(r"^(?P<prefix>.*\.attention)\.conv1d\.weight$")
_FUSED_GATE_UP = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.down_proj$")


def _rename(name: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, replacement in rules:
        name = pattern.sub(replacement, name)
    return name


def to_official(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One internal tensor under its official name(s).

    The fused short convolution ``[3C, 1, K]`` becomes ``q``/``k``/``v`` ``[C, 1, K]``; the
    fused experts ``gate_up_proj`` ``[n, 2I, H]`` and ``down_proj`` ``[n, H, I]`` become
    ``n`` per-expert ``gate_proj``/``up_proj`` ``[I, H]`` and ``down_proj`` ``[H, I]``.
    Split parts are views of ``tensor`` (clone them before saving to safetensors).
    """
    renamed = _rename(name, _TO_OFFICIAL)
    if match := _FUSED_CONV.match(renamed):
        q, k, v = tensor.chunk(3, dim=0)
        prefix = match["prefix"]
        return [(f"{prefix}.{part}_conv1d.weight", t) for part, t in zip("qkv", (q, k, v))]
    if match := _FUSED_GATE_UP.match(renamed):
        prefix, inter = match["prefix"], tensor.shape[1] // 2
        out = []
        for e in range(tensor.shape[0]):
            out.append((f"{prefix}.{e}.gate_proj.weight", tensor[e, :inter]))
            out.append((f"{prefix}.{e}.up_proj.weight", tensor[e, inter:]))
        return out
    if match := _FUSED_DOWN.match(renamed):
        prefix = match["prefix"]
        return [(f"{prefix}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    return [(renamed, tensor)]


def to_official_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`to_official` over a whole state dict (split parts are views)."""
    return {key: t for name, tensor in state.items() for key, t in to_official(name, tensor)}


# --- official -> internal ---

_TO_HF = [
    (re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.self_attn\.(f_proj\.|dt_bias$|A_log$)"), r".self_attn.forget_gate.\1"),
    (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
]
_CONV_PART = re.compile(r"^(?P<prefix>.*\.self_attn)\.(?P<part>[qkv])_conv1d\.weight$")
_EXPERT_PART = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\.weight$"
)


class HFStateAssembler:
    """Turns official ``(name, tensor)`` pairs, in any order, into internal ones.

    A renamed tensor comes out of :meth:`add` at once; a fused one when its last part
    arrives (three convolution parts; ``2 * num_experts`` expert projections for
    ``gate_up_proj``, ``num_experts`` for ``down_proj``). Weight updates that stream tensors
    in buckets feed every tensor through one assembler and call :meth:`finish` at the end.
    """

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        # fused internal name -> {part key: tensor}
        self._parts: dict[str, dict[Any, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        renamed = _rename(name, _TO_HF)
        if match := _CONV_PART.match(renamed):
            fused = f"{match['prefix']}.conv1d.weight"
            return self._collect(fused, match["part"], tensor, needed=3)
        if match := _EXPERT_PART.match(renamed):
            expert, part = int(match["expert"]), match["part"]
            if expert >= self.num_experts:
                raise ValueError(f"{name}: expert {expert} of a model with {self.num_experts}")
            if part == "down":
                fused = f"{match['prefix']}.down_proj"
                return self._collect(fused, expert, tensor, needed=self.num_experts)
            fused = f"{match['prefix']}.gate_up_proj"
            return self._collect(fused, (expert, part), tensor, needed=2 * self.num_experts)
        return [(renamed, tensor)]

    def _collect(
        self, fused: str, key: Any, tensor: torch.Tensor, needed: int
    ) -> list[tuple[str, torch.Tensor]]:
        parts = self._parts.setdefault(fused, {})
        if key in parts:
            raise ValueError(f"{fused}: part {key!r} given twice")
        parts[key] = tensor
        if len(parts) < needed:
            return []
        del self._parts[fused]
        return [(fused, _fuse(fused, parts, self.num_experts))]

    def pending(self) -> list[str]:
        """Internal names still waiting for parts."""
        return sorted(self._parts)

    def finish(self) -> None:
        """Raise if a fused tensor is incomplete (a part was never given)."""
        if self._parts:
            raise ValueError(f"incomplete fused tensors: {self.pending()[:5]}")


def _fuse(fused: str, parts: dict[Any, torch.Tensor], num_experts: int) -> torch.Tensor:
    if fused.endswith(".conv1d.weight"):
        return torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    if fused.endswith(".down_proj"):
        return torch.stack([parts[e] for e in range(num_experts)])
    return torch.stack(
        [torch.cat([parts[(e, "gate")], parts[(e, "up")]], dim=0) for e in range(num_experts)]
    )


def to_hf_state_dict(
    state: Mapping[str, torch.Tensor], num_experts: int | None = None
) -> dict[str, torch.Tensor]:
    """A whole official state dict under internal names (fused tensors merged).

    ``num_experts`` defaults to the number of experts the names mention.
    """
    if num_experts is None:
        indices = [int(m["expert"]) for n in state if (m := _EXPERT_PART.match(_rename(n, _TO_HF)))]
        num_experts = max(indices) + 1 if indices else 0
    assembler = HFStateAssembler(num_experts)
    out = {k: t for name, tensor in state.items() for k, t in assembler.add(name, tensor)}
    assembler.finish()
    return out


# --- configs and registration ---


def is_bailing_config(config: Any) -> bool:
    """Whether ``config`` (an HF config object) describes a Ling 3 model."""
    if getattr(config, "model_type", None) in (MODEL_TYPE, ALIAS_MODEL_TYPE):
        return True
    return OFFICIAL_ARCHITECTURE in (getattr(config, "architectures", None) or [])


# transformers' spelling of a config key -> the official one (both load; only the official
# one is read by the reference implementation and by SGLang)
_OFFICIAL_CONFIG_KEYS = {
    "num_experts_per_token": "num_experts_per_tok",
    "num_expert_group": "n_group",
    "model_max_length": "max_position_embeddings",
    "moe_renormalize": "norm_topk_prob",
}
# derived on load from head_dim and short_conv_kernel_size
_DERIVED_CONFIG_KEYS = ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")


def write_official_config(
    path: str | os.PathLike[str], source: str | os.PathLike[str] | None = None
) -> None:
    """Rewrite ``path/config.json`` (as ``save_pretrained`` wrote it) the way Ling 3
    checkpoints spell it.

    With ``source`` (the directory the model was loaded from) holding a ``config.json`` of
    the same model type, that file is copied: training changes no hyper-parameter. Otherwise
    the keys are translated: the official architecture, ``head_dim`` back to the KDA/attention
    head size (transformers stores the rotary size there), official key names.
    """
    target = Path(path) / "config.json"
    saved = json.loads(target.read_text())
    if source is not None and (Path(source) / "config.json").is_file():
        original = json.loads((Path(source) / "config.json").read_text())
        if original.get("model_type") == saved.get("model_type"):
            original["architectures"] = [OFFICIAL_ARCHITECTURE]
            target.write_text(json.dumps(original, indent=2, sort_keys=True) + "\n")
            return
    config = {_OFFICIAL_CONFIG_KEYS.get(k, k): v for k, v in saved.items()}
    if "linear_head_dim" in config:
        config["head_dim"] = config["linear_head_dim"]
    for key in _DERIVED_CONFIG_KEYS:
        config.pop(key, None)
    config["architectures"] = [OFFICIAL_ARCHITECTURE]
    target.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@functools.cache
def _alias_classes() -> tuple[type, type] | None:
    """``bailing_moe_v3`` config and model classes (None without transformers' model)."""
    try:
        from transformers import BailingHybridConfig, BailingHybridForCausalLM
    except ImportError:
        return None

    class BailingMoeV3Config(BailingHybridConfig):
        """``bailing_hybrid`` under the alias model type ``bailing_moe_v3``."""

        model_type = ALIAS_MODEL_TYPE

    class BailingMoeV3ForCausalLM(BailingHybridForCausalLM):
        """``BailingHybridForCausalLM`` for :class:`BailingMoeV3Config`; saves under the
        official architecture name."""

        config_class = BailingMoeV3Config

    return BailingMoeV3Config, BailingMoeV3ForCausalLM


@functools.cache
def register() -> bool:
    """Register the ``bailing_moe_v3`` alias with ``AutoConfig``, ``AutoModelForCausalLM``
    and transformers' checkpoint conversion mapping; idempotent.

    Returns False (and registers nothing) when this transformers has no ``bailing_hybrid``.
    """
    classes = _alias_classes()
    if classes is None:
        return False
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    config_cls, model_cls = classes
    AutoConfig.register(ALIAS_MODEL_TYPE, config_cls, exist_ok=True)
    AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
    mapping = get_checkpoint_conversion_mapping(MODEL_TYPE)
    if mapping is not None:
        register_checkpoint_conversion_mapping(ALIAS_MODEL_TYPE, mapping, overwrite=True)
    return True
