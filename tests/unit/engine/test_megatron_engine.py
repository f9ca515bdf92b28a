"""MegatronEngine on CPU (one gloo rank, fp32) against Hugging Face and the FSDP engine.

megatron-core assumes CUDA in a few places; :mod:`tests.unit.engine.megatron_cpu_shim`
replaces those for the duration of this module only. The tiny Qwen3 model is the shared
``tiny_model_dir`` fixture (2 layers, hidden 64, untied LM head).
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine import megatron_cpu_shim

available, reason = megatron_cpu_shim.megatron_available()
pytestmark = pytest.mark.skipif(not available, reason=reason)

# Megatron and HF run the same fp32 math in different orders (fused QKV and gate/up
# projections, RoPE on split halves): log-probs agree to float32 rounding of sums over
# the 1024-token vocabulary, well under 1e-4.
LOGP_ATOL = 1e-4


@pytest.fixture(scope="module")
def cpu_shim():
    with megatron_cpu_shim.cpu_megatron():
        yield


def make_engine(model_dir, lr: float = 1.0, use_kernels: bool = False, optimizer: str = "sgd"):
    from areal.api.cli_args import (
        MegatronDDPConfig,
        MegatronEngineConfig,
        MicroBatchSpec,
        OptimizerConfig,
        TrainEngineConfig,
    )
    from areal.engine.megatron_engine import MegatronEngine

    config = TrainEngineConfig(
        experiment_name="test",
        trial_name="megatron",
        path=str(model_dir),
        dtype="float32",
        use_kernels=use_kernels,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=32),  # several packed micro-batches
        # SGD with lr 1 and no clipping: the update is exactly minus the gradient
        optimizer=OptimizerConfig(type=optimizer, lr=lr, weight_decay=0.0, gradient_clipping=0.0),
        # Megatron's distributed optimizer allocates on CUDA; CPU uses the plain one
        megatron=MegatronEngineConfig(ddp=MegatronDDPConfig(use_distributed_optimizer=False)),
    )
    engine = MegatronEngine(config)
    engine.create_process_group()
    engine.initialize()
    return engine


def count(mb: dict) -> torch.Tensor:
    return mb["loss_mask"].count_nonzero()


@pytest.fixture(scope="module")
def megatron_run(cpu_shim, tiny_model_dir, tmp_path_factory):
    """One Megatron engine: log-probs before, one SGD step, HF export, DCP round trip."""
    from areal.api.io_struct import SaveLoadMeta
    from tests.unit.engine.fsdp_worker import fixed_batch, token_mean_nll

    batch = fixed_batch()
    out = tmp_path_factory.mktemp("megatron")
    engine = make_engine(tiny_model_dir)
    try:
        before_state = engine.hf_state_dict()
        before_logp = engine.forward_batch(batch)
        stats = engine.train_batch(batch, token_mean_nll, count)
        after_state = engine.hf_state_dict()
        after_logp = engine.forward_batch(batch)
        engine.save(SaveLoadMeta(path=str(out / "hf"), weight_format="hf", with_optim=False))
        engine.save(SaveLoadMeta(path=str(out / "dcp"), weight_format="dcp", with_optim=True))
        engine.train_batch(batch, token_mean_nll, count)  # move away, then recover
        moved_logp = engine.forward_batch(batch)
        engine.load(SaveLoadMeta(path=str(out / "dcp"), weight_format="dcp", with_optim=True))
        recovered_logp = engine.forward_batch(batch)
    finally:
        engine.destroy()
    return {
        "batch": batch,
        "before_state": before_state,
        "after_state": after_state,
        "before_logp": before_logp,
        "after_logp": after_logp,
        "moved_logp": moved_logp,
        "recovered_logp": recovered_logp,
        "stats": stats,
        "hf_dir": out / "hf",
    }


@pytest.fixture(scope="module")
def fsdp_run(megatron_run, tiny_model_dir):
    """The FSDP engine's step on the same batch with the same optimizer settings."""
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.engine.fsdp_engine import FSDPEngine
    from tests.unit.engine.fsdp_worker import token_mean_nll

    config = TrainEngineConfig(
        experiment_name="test",
        trial_name="fsdp",
        path=str(tiny_model_dir),
        dtype="float32",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=32),
        optimizer=OptimizerConfig(type="sgd", lr=1.0, weight_decay=0.0, gradient_clipping=0.0),
    )
    engine = FSDPEngine(config)
    engine.create_process_group()
    engine.initialize()
    try:
        before = {k: v.clone() for k, v in engine._full_state_dict().items()}
        stats = engine.train_batch(megatron_run["batch"], token_mean_nll, count)
        after = engine._full_state_dict()
    finally:
        engine.destroy()
    return {"before": before, "after": after, "stats": stats}


def test_hf_weights_load_into_megatron_with_matching_log_probs(megatron_run, tiny_model_dir):
    from tests.unit.engine.test_fsdp_engine import unpacked_logprobs

    batch = megatron_run["batch"]
    expected = unpacked_logprobs(tiny_model_dir, batch)
    got = megatron_run["before_logp"]
    real = batch["attention_mask"]
    assert got.shape == expected.shape
    diff = (got[real] - expected[real]).abs().max()
    assert diff < LOGP_ATOL, diff
    assert (got[~real] == 0).all()


def test_train_batch_matches_fsdp_loss_and_update(megatron_run, fsdp_run):
    m_stats, f_stats = megatron_run["stats"], fsdp_run["stats"]
    assert m_stats["update_successful"] == 1.0
    assert m_stats["num_micro_batches"] == f_stats["num_micro_batches"]
    # both are the token mean of the NLL over the same trainable tokens
    assert m_stats["loss"] == pytest.approx(f_stats["loss"], rel=1e-5)
    assert m_stats["grad_norm"] == pytest.approx(f_stats["grad_norm"], rel=1e-3)
    names = sorted(fsdp_run["before"])
    assert sorted(megatron_run["after_state"]) == names
    m_update = torch.cat(
        [
            (megatron_run["after_state"][n] - megatron_run["before_state"][n]).flatten()
            for n in names
        ]
    )
    f_update = torch.cat([(fsdp_run["after"][n] - fsdp_run["before"][n]).flatten() for n in names])
    cosine = torch.nn.functional.cosine_similarity(m_update, f_update, dim=0)
    assert cosine > 0.999, cosine  # same direction; fp32 leaves only rounding
    assert torch.allclose(m_update, f_update, atol=1e-4)


def test_hf_export_reproduces_the_trained_model(megatron_run):
    from tests.unit.engine.test_fsdp_engine import unpacked_logprobs

    batch = megatron_run["batch"]
    real = batch["attention_mask"]
    exported = unpacked_logprobs(megatron_run["hf_dir"], batch)
    trained = megatron_run["after_logp"]
    assert (trained[real] - megatron_run["before_logp"][real]).abs().max() > 1e-2
    assert (exported[real] - trained[real]).abs().max() < LOGP_ATOL


def test_dcp_checkpoint_recovers_the_weights(megatron_run):
    real = megatron_run["batch"]["attention_mask"]
    after, moved = megatron_run["after_logp"][real], megatron_run["moved_logp"][real]
    assert (moved - after).abs().max() > 1e-2
    assert torch.allclose(megatron_run["recovered_logp"][real], after, atol=1e-6)


def test_fused_kernels_give_the_eager_log_probs_and_steps(cpu_shim, tiny_model_dir, tmp_path):
    """``use_kernels``: compiled log-prob chunks and rotary embedding, Megatron's fused
    SwiGLU and bias-dropout-add, and torch's fused AdamW give eager's numbers; several packed
    lengths run through the compiled graphs. The fused optimizer's state survives a DCP
    round trip: the step after a reload repeats the step after the save."""
    import torch._dynamo
    from megatron.core.utils import get_model_config

    from areal.api.io_struct import SaveLoadMeta
    from areal.engine.megatron_compat import COMPILED_ROPE_ATTR
    from tests.unit.engine.fsdp_worker import fixed_batch, token_mean_nll

    batch = fixed_batch()
    mask = batch["loss_mask"].bool()
    runs = []
    for use_kernels in (False, True):
        engine = make_engine(tiny_model_dir, lr=1e-2, use_kernels=use_kernels, optimizer="adam")
        try:
            config = get_model_config(engine.model[0])
            assert config.bias_activation_fusion is use_kernels
            assert config.bias_dropout_fusion is use_kernels
            assert getattr(config, COMPILED_ROPE_ATTR, False) is use_kernels
            inner = engine.optimizer.optimizer
            assert inner.param_groups[0]["fused"] is (True if use_kernels else None)
            before = engine.forward_batch(batch)
            losses = [engine.train_batch(batch, token_mean_nll, count)["loss"]]
            ckpt = SaveLoadMeta(path=str(tmp_path / f"dcp{use_kernels}"), weight_format="dcp",
                                with_optim=True)  # fmt: skip
            engine.save(ckpt)
            losses.append(engine.train_batch(batch, token_mean_nll, count)["loss"])
            after = engine.forward_batch(batch)
            engine.load(ckpt)
            losses.append(engine.train_batch(batch, token_mean_nll, count)["loss"])
        finally:
            engine.destroy()
        runs.append((before, losses, after))
    (eager_before, eager_losses, eager_after), (fused_before, fused_losses, fused_after) = runs
    torch.testing.assert_close(fused_before[mask], eager_before[mask], rtol=1e-5, atol=1e-5)
    assert fused_losses == pytest.approx(eager_losses, rel=1e-5)
    torch.testing.assert_close(fused_after[mask], eager_after[mask], rtol=1e-4, atol=1e-4)
    assert (eager_after[mask] - eager_before[mask]).abs().max() > 1e-3  # the steps did move
    assert eager_losses[1] < eager_losses[0]
    for losses in (eager_losses, fused_losses):  # the reloaded step repeats the saved one
        assert losses[2] == pytest.approx(losses[1], rel=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # something compiled


def test_allocation_string_sets_the_parallel_layout(cpu_shim, tiny_model_dir):
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import TrainEngineConfig
    from areal.engine.megatron_engine import MegatronEngine

    engine = MegatronEngine(TrainEngineConfig(experiment_name="t", trial_name="t"))
    with pytest.raises(ValueError, match="spans 4 ranks"):
        engine._strategy(ModelAllocation.from_str("megatron:d2t2p1c1").parallel, world=1)
    assert (
        engine._strategy(ModelAllocation.from_str("megatron:d1c2").parallel, world=2).cp_size == 2
    )
    hybrid = ModelAllocation.from_str("megatron:(attn:d2t2p1|ffn:d1t1e4)").parallel
    assert engine._strategy(hybrid, world=4).ep_size == 4


# --- MoE (Qwen3-MoE through mbridge, local SequentialMLP experts) ---


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    from areal.utils.tiny_model import build_tiny_model

    # 2 layers, 4 experts of width 128, top-2 routing with normalized weights
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3-moe", arch="qwen3_moe")


def test_moe_model_loads_trains_and_exports(cpu_shim, moe_model_dir, tmp_path):
    """HF -> Megatron log-probs equal HF's, a step trains, the HF export has the step."""
    from areal.api.io_struct import SaveLoadMeta
    from tests.unit.engine.fsdp_worker import fixed_batch, token_mean_nll
    from tests.unit.engine.test_fsdp_engine import unpacked_logprobs

    batch = fixed_batch()
    real = batch["attention_mask"]
    engine = make_engine(moe_model_dir)
    try:
        assert engine.bridge.config.num_moe_experts == 4
        before = engine.forward_batch(batch)
        stats = engine.train_batch(batch, token_mean_nll, count)
        after = engine.forward_batch(batch)
        engine.save(SaveLoadMeta(path=str(tmp_path / "hf"), weight_format="hf", with_optim=False))
        exported_names = set(engine.hf_state_dict())
    finally:
        engine.destroy()
    expected = unpacked_logprobs(moe_model_dir, batch)
    assert (before[real] - expected[real]).abs().max() < LOGP_ATOL
    assert stats["update_successful"] == 1.0
    assert (after[real] - before[real]).abs().max() > 1e-2
    # every expert's three projections come back under their HF names
    for layer in range(2):
        for expert in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight" in exported_names
    exported = unpacked_logprobs(tmp_path / "hf", batch)
    assert (exported[real] - after[real]).abs().max() < LOGP_ATOL
