"""FSDPEngine (``fsdp:d1`` on CPU) training the tiny Ling 3 model on packed micro-batches."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from areal.api.io_struct import SaveLoadMeta
from tests.unit.engine.fsdp_worker import fixed_batch, token_mean_nll
from tests.unit.engine.test_fsdp_engine import count, make_engine, unpacked_logprobs


@pytest.fixture
def engine(bailing_model_dir):
    engine = make_engine(bailing_model_dir, mb_tokens=48)
    yield engine
    engine.destroy()


def long_batch() -> dict[str, torch.Tensor]:
    """Rows of up to 90 tokens, so a packed stream crosses KDA's 64-token chunks."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([90, 12, 67, 5, 40])
    mask = torch.arange(90)[None] < lengths[:, None]
    ids = torch.randint(3, 1000, (len(lengths), 90), generator=g) * mask
    loss_mask = mask.clone()
    loss_mask[torch.arange(len(lengths)), lengths - 1] = False
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask.long()}


@pytest.mark.parametrize("make_batch", [fixed_batch, long_batch])
def test_packed_log_probs_equal_one_sequence_at_a_time(bailing_model_dir, make_batch):
    batch = make_batch()
    expected = unpacked_logprobs(bailing_model_dir, batch)
    real = batch["attention_mask"]
    for mb_tokens in (48, 4096):  # several packed streams, then the whole batch in one
        engine = make_engine(bailing_model_dir, mb_tokens=mb_tokens)
        try:
            got = engine.forward_batch(batch)
        finally:
            engine.destroy()
        torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-5)
        assert (got[~real] == 0).all()


def test_a_training_step_moves_every_trained_kind_of_weight(engine):
    batch = fixed_batch()
    before = engine._full_state_dict()
    stats = engine.train_batch(batch, token_mean_nll, count)
    assert stats["update_successful"] == 1.0
    assert torch.isfinite(torch.tensor([stats["loss"], stats["grad_norm"]])).all()
    after = engine._full_state_dict()
    for name in (
        "model.layers.0.self_attn.conv1d.weight",
        "model.layers.0.self_attn.forget_gate.dt_bias",
        "model.layers.1.self_attn.kv_b_proj.weight",
        "model.layers.2.mlp.experts.gate_up_proj",
        "model.layers.3.mlp.gate.weight",
        "lm_head.weight",
    ):
        assert not torch.equal(before[name], after[name]), name


def test_training_raises_the_log_prob_of_trained_tokens(engine):
    batch = fixed_batch()
    mask = batch["loss_mask"].bool()
    before = engine.forward_batch(batch)[mask].mean()
    for _ in range(3):
        assert engine.train_batch(batch, token_mean_nll, count)["update_successful"] == 1.0
    assert engine.forward_batch(batch)[mask].mean() > before + 0.5


def test_hf_save_is_an_official_checkpoint_that_reloads(engine, bailing_model_dir, tmp_path):
    batch = fixed_batch()
    engine.train_batch(batch, token_mean_nll, count)
    out = tmp_path / "hf"
    engine.save(SaveLoadMeta(path=str(out), weight_format="hf"))
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (bailing_model_dir / "config.json").read_text()
    )
    saved = load_file(str(out / "model.safetensors"))
    assert set(saved) == set(load_file(str(bailing_model_dir / "model.safetensors")))
    expected = engine.forward_batch(batch)
    real = batch["attention_mask"]
    torch.testing.assert_close(
        unpacked_logprobs(out, batch)[real], expected[real], rtol=0, atol=1e-5
    )
    # the engine's own HF load reads the official names back
    fresh = make_engine(bailing_model_dir)
    try:
        fresh.load(SaveLoadMeta(path=str(out), weight_format="hf"))
        torch.testing.assert_close(fresh.forward_batch(batch), expected, rtol=0, atol=1e-6)
    finally:
        fresh.destroy()


def test_weights_for_inference_carry_the_checkpoint_names(engine, bailing_model_dir):
    """Servers loaded the official checkpoint (SGLang), so updates use its names."""
    sent = {name: tuple(t.shape) for name, t in engine._weights_for_inference()}
    on_disk = load_file(str(bailing_model_dir / "model.safetensors"))
    # every checkpoint tensor but the router's expert bias, a buffer that is not trained
    assert set(sent) == {n for n in on_disk if not n.endswith("expert_bias")}
    assert all(sent[n] == tuple(on_disk[n].shape) for n in sent)
