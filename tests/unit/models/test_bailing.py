"""Ling 3 (``BailingMoeV3ForCausalLM``) on transformers' ``bailing_hybrid``: loading, names,
forward/backward, cached decoding and the packed-sequence KDA forward."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal.engine.attention import packed_forward_kwargs, register_varlen_attention
from areal.engine.kda import packed_causal_conv1d
from areal.models import bailing, save_pretrained
from areal.models.bailing_packed import enable_packed_sequences


def load(model_dir: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)


@pytest.fixture(scope="module")
def model(bailing_model_dir):
    return load(bailing_model_dir).eval()


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def test_checkpoint_is_laid_out_like_a_real_one(bailing_model_dir, ling3_tokenizer):
    config = json.loads((bailing_model_dir / "config.json").read_text())
    assert config["architectures"] == ["BailingMoeV3ForCausalLM"]
    assert config["model_type"] == "bailing_hybrid"
    assert config["num_nextn_predict_layers"] == 0
    assert config["vocab_size"] == len(ling3_tokenizer)
    names = set(checkpoint(bailing_model_dir))
    for official in (
        "model.word_embeddings.weight",
        "model.layers.0.attention.q_conv1d.weight",
        "model.layers.0.attention.f_proj.weight",
        "model.layers.0.attention.dense.weight",
        "model.layers.1.attention.kv_a_proj_with_mqa.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.layers.1.mlp.gate.expert_bias",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
        "lm_head.weight",
    ):
        assert official in names
    assert not [n for n in names if ".self_attn." in n or "embed_tokens" in n]
    assert (bailing_model_dir / "generation_config.json").is_file()
    assert (bailing_model_dir / "tokenizer.json").is_file()


def test_auto_classes_load_every_weight(bailing_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(bailing_model_dir)
    assert config.layer_types == ["linear_attention", "full_attention"] * 2
    assert config.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert (config.linear_head_dim, config.n_group, config.topk_group) == (16, 2, 1)
    model, info = load(bailing_model_dir, output_loading_info=True)
    assert type(model).__name__ == "BailingHybridForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    expected = bailing.to_hf_state_dict(checkpoint(bailing_model_dir), num_experts=4)
    state = model.state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(state[k], expected[k]) for k in state)


def test_official_names_round_trip_exactly(model, bailing_model_dir):
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    official = bailing.to_official_state_dict(state)
    # the same names and tensors as the checkpoint and as transformers' own save conversion
    saved = checkpoint(bailing_model_dir)
    assert set(official) == set(saved)
    assert all(torch.equal(official[k], saved[k]) for k in saved)
    reverted = revert_weight_conversion(model, dict(state))
    assert set(reverted) == set(official)
    assert all(torch.equal(reverted[k], official[k]) for k in official)
    # back, streamed in a shuffled order through one assembler
    pairs = list(official.items())
    random.Random(0).shuffle(pairs)
    assembler = bailing.HFStateAssembler(num_experts=4)
    back = {k: t for name, tensor in pairs for k, t in assembler.add(name, tensor)}
    assembler.finish()
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    # internal names are left alone, so a state of either naming can be passed
    assert bailing.to_hf_state_dict(state, num_experts=4).keys() == state.keys()


def test_an_incomplete_fused_tensor_is_refused():
    assembler = bailing.HFStateAssembler(num_experts=2)
    part = torch.zeros(8, 1, 4)
    assert assembler.add("model.layers.0.attention.q_conv1d.weight", part) == []
    assert assembler.add("model.layers.0.attention.k_conv1d.weight", part) == []
    assert assembler.pending() == ["model.layers.0.self_attn.conv1d.weight"]
    with pytest.raises(ValueError, match="incomplete"):
        assembler.finish()
    with pytest.raises(ValueError, match="expert 2"):
        assembler.add("model.layers.1.mlp.experts.2.up_proj.weight", torch.zeros(4, 8))


def test_alias_model_type_loads_the_same_model(model, bailing_model_dir, tmp_path):
    alias = tmp_path / "alias"
    shutil.copytree(bailing_model_dir, alias)
    config = json.loads((alias / "config.json").read_text())
    (alias / "config.json").write_text(json.dumps({**config, "model_type": "bailing_moe_v3"}))
    loaded, info = load(alias, output_loading_info=True)
    assert type(loaded).__name__ == "BailingMoeV3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.tensor([[5, 17, 99, 3, 250]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_save_writes_the_official_config(model, bailing_model_dir, tmp_path):
    """Without the source checkpoint, transformers' spelling is translated back."""
    save_pretrained(model, tmp_path / "translated")
    written = json.loads((tmp_path / "translated" / "config.json").read_text())
    original = json.loads((bailing_model_dir / "config.json").read_text())
    assert written["architectures"] == ["BailingMoeV3ForCausalLM"]
    for key in ("head_dim", "n_group", "num_experts_per_tok", "max_position_embeddings"):
        assert written[key] == original[key], key
    assert not {"linear_head_dim", "num_expert_group"} & set(written)
    assert set(checkpoint(tmp_path / "translated")) == set(checkpoint(bailing_model_dir))
    reloaded = load(tmp_path / "translated")
    ids = torch.tensor([[5, 17, 99, 3, 250]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    save_pretrained(model, tmp_path / "copied", source=bailing_model_dir)
    assert json.loads((tmp_path / "copied" / "config.json").read_text()) == original


def test_forward_and_backward_reach_every_kind_of_layer(bailing_model_dir):
    model = load(bailing_model_dir).train()
    ids = torch.randint(3, 1000, (2, 40), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert all(torch.isfinite(g).all() for g in grads.values())
    for name in (
        "model.layers.0.self_attn.conv1d.weight",  # KDA
        "model.layers.0.self_attn.forget_gate.A_log",
        "model.layers.1.self_attn.kv_b_proj.weight",  # MLA
        "model.layers.2.mlp.experts.gate_up_proj",  # routed experts
        "model.layers.2.mlp.gate.weight",  # grouped router
        "model.layers.3.mlp.shared_experts.up_proj.weight",
    ):
        assert grads[name].abs().sum() > 0, name


def test_cached_decoding_equals_a_full_forward(model):
    prompt = torch.tensor([[11, 250, 37, 4, 812, 90, 6]])
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        cache, tokens, step_logits = out.cache, prompt, [out.logits[0, -1]]
        for _ in range(12):
            token = step_logits[-1].argmax().view(1, 1)
            tokens = torch.cat([tokens, token], dim=1)
            out = model(input_ids=token, cache=cache, use_cache=True)
            cache = out.cache
            step_logits.append(out.logits[0, -1])
        full = model(input_ids=tokens).logits[0, prompt.shape[1] - 1 :]
    torch.testing.assert_close(torch.stack(step_logits), full, rtol=0, atol=1e-5)


# --- packed sequences ---


def test_segment_convolution_restarts_at_every_boundary():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3]
    x = torch.randn(sum(lengths), 6, generator=g)
    weight = torch.randn(6, 1, 4, generator=g)
    cu = torch.tensor([0, 5, 6, 15, 18])
    got = torch.nn.functional.silu(packed_causal_conv1d(x, weight, cu))
    conv = torch.nn.functional.conv1d
    expected = torch.cat(
        [
            conv(seg.T[None], weight, padding=3, groups=6)[0, :, : len(seg)].T
            for seg in x.split(lengths)
        ]
    )
    torch.testing.assert_close(got, torch.nn.functional.silu(expected), rtol=0, atol=1e-6)


def test_packed_forward_equals_one_sequence_at_a_time(bailing_model_dir):
    model = load(bailing_model_dir, attn_implementation=register_varlen_attention()).eval()
    g = torch.Generator().manual_seed(1)
    lengths = [7, 70, 3, 1, 20]  # 70 spans two 64-token KDA chunks
    seqs = [torch.randint(3, 1000, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = packed_forward_kwargs(cu, max(lengths))
    with torch.no_grad():
        expected = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
        # transformers' KDA layers alone let state cross the boundaries
        leaked = model(input_ids=ids, position_ids=positions, **packed).logits[0]
        assert enable_packed_sequences(model) == 2
        assert enable_packed_sequences(model) == 2  # idempotent
        got = model(input_ids=ids, position_ids=positions, **packed).logits[0]
    assert (leaked - expected).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert set(model.state_dict()) == set(load(bailing_model_dir).state_dict())
