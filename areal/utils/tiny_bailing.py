"""A tiny random Ling 3 (``BailingMoeV3ForCausalLM``) checkpoint, built offline.

It has every part of the flagship model at toy sizes: KDA and MLA layers alternating
(``layer_group_size=2``: layers 0 and 2 KDA, 1 and 3 MLA), a dense first layer, then
grouped-router MoE (4 routed experts in 2 groups, 1 group and 2 experts per token, 1
shared expert), no MTP layers. The directory is laid out as a real checkpoint: a
``config.json`` in the official spelling (``architectures: ["BailingMoeV3ForCausalLM"]``,
``model_type: bailing_hybrid``), the official weight names in ``model.safetensors``, a
generation config and the Ling 3 chat tokenizer (:func:`build_ling3_tokenizer`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from areal.utils.tiny_model import build_ling3_tokenizer

__all__ = [
    "TINY_BAILING_SHAPE",
    "build_bailing_model",
    "build_tiny_bailing_model",
    "write_bailing_config",
]

# The config.json keys of the tiny model, in the official spelling.
TINY_BAILING_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    layer_group_size=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_experts=4,
    num_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    num_nextn_predict_layers=0,
    short_conv_kernel_size=4,
    kda_safe_gate=True,
    kda_lower_bound=-5.0,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=6000000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def write_bailing_config(path: str | os.PathLike[str], shape: dict[str, Any]) -> Path:
    """Write the official ``config.json`` of a Ling 3 model of ``shape`` (official key
    spelling; ``vocab_size`` defaults to the Ling 3 tokenizer's) and that tokenizer."""
    from areal.models import bailing

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_ling3_tokenizer()
    official = {
        "architectures": [bailing.OFFICIAL_ARCHITECTURE],
        "model_type": bailing.MODEL_TYPE,
        "vocab_size": len(tok),
        **shape,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
        "bos_token_id": None,
        "dtype": "float32",
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(official, indent=2, sort_keys=True) + "\n")
    tok.save_pretrained(out)
    return out


def build_bailing_model(path: str | os.PathLike[str], shape: dict[str, Any], seed: int = 0) -> Path:
    """Write a random float32 Ling 3 checkpoint of ``shape``, as a real one is laid out:
    official config and weight names, generation config, the Ling 3 tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from areal.models import bailing

    out = write_bailing_config(path, shape)
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a zero bias would leave the router's correction term untested
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    state = bailing.to_official_state_dict(model.state_dict())
    del model
    save_file(
        {k: v.detach().contiguous() for k, v in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    eos, pad = config.eos_token_id, config.pad_token_id
    GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad).save_pretrained(out)
    return out


def build_tiny_bailing_model(path: str | os.PathLike[str], seed: int = 0) -> Path:
    """A random tiny Ling 3 checkpoint (:data:`TINY_BAILING_SHAPE`) with the Ling 3
    tokenizer at ``path``. Weights are float32 (the CPU tests compare packed and
    per-sequence forwards to 1e-5). Returns the path."""
    return build_bailing_model(path, TINY_BAILING_SHAPE, seed)
