"""Ling 3 (``BailingMoeV3ForCausalLM``) on the Megatron engine, on CPU, against Hugging Face.

The model is the shared ``bailing_model_dir`` fixture: 2 KDA + 2 MLA layers, a dense first
layer, 4 routed experts in 2 router groups plus a shared expert, official config and weight
names. megatron-core's CUDA assumptions are replaced by
:mod:`tests.unit.engine.megatron_cpu_shim` for this module only (and in each worker process
of the multi-rank tests).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.unit.engine import megatron_cpu_shim

available, reason = megatron_cpu_shim.megatron_available()
pytestmark = pytest.mark.skipif(not available, reason=reason)

# fp32 on both sides; the KDA recurrence runs chunked here and token by token in HF's
# reference (or chunked with another chunk size), which reorders float32 sums only
LOGP_ATOL = 1e-5


def build_q_lora_variant(path):
    """The tiny model with a low-rank query projection in its MLA layers (``q_lora_rank``),
    saved by transformers (official weight names, transformers' config spelling)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from areal.utils.tiny_bailing import TINY_BAILING_SHAPE

    shape = {k: v for k, v in TINY_BAILING_SHAPE.items() if k != "num_experts"}
    config = AutoConfig.for_model(
        "bailing_hybrid",
        vocab_size=128,
        num_local_experts=4,
        pad_token_id=0,
        eos_token_id=1,
        **{**shape, "q_lora_rank": 24},
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    model.save_pretrained(path)
    return path


def run_ranks(
    model_dir, out, backend: str, train: bool, world: int = 2, mb_tokens: int = 32
) -> dict:
    """:mod:`tests.unit.engine.megatron_bailing_worker` on ``world`` gloo ranks."""
    from tests.unit.engine.test_fsdp_engine import REPO, find_free_port

    port = find_free_port("127.0.0.1")
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
        }
        argv = [sys.executable, "-m", "tests.unit.engine.megatron_bailing_worker",
                "--model", str(model_dir), "--out", str(out), "--backend", backend,
                "--mb-tokens", str(mb_tokens), *(["--train"] if train else [])]  # fmt: skip
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env))
    try:
        for proc in procs:
            assert proc.wait(timeout=600) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def cpu_shim():
    with megatron_cpu_shim.cpu_megatron():
        yield


def make_engine(model_dir, optimizer: str | None = "sgd", dtype: str = "float32"):
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
        trial_name="ling3",
        path=str(model_dir),
        dtype=dtype,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=32),  # several packed micro-batches
        optimizer=(
            OptimizerConfig(type=optimizer, lr=1.0, weight_decay=0.0, gradient_clipping=0.0)
            if optimizer
            else None
        ),
        megatron=MegatronEngineConfig(ddp=MegatronDDPConfig(use_distributed_optimizer=False)),
    )
    engine = MegatronEngine(config)
    engine.create_process_group()
    engine.initialize()
    return engine


def long_batch() -> dict[str, torch.Tensor]:
    """Rows of up to 90 tokens: KDA's chunked recurrence runs several chunks per row."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([90, 12, 67, 5, 40])
    mask = torch.arange(90)[None] < lengths[:, None]
    ids = torch.randint(3, 120, (len(lengths), 90), generator=g) * mask
    loss_mask = mask.clone()
    loss_mask[torch.arange(len(lengths)), lengths - 1] = False
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask.long()}


def count(mb: dict) -> torch.Tensor:
    return mb["loss_mask"].count_nonzero()


def hf_logprobs(model_dir, batch: dict) -> torch.Tensor:
    from tests.unit.engine.test_fsdp_engine import unpacked_logprobs

    return unpacked_logprobs(model_dir, batch)


# --- KDA maths ---


def test_chunked_kda_equals_the_token_recurrence_per_segment():
    """The chunked form equals the plain recurrence, restarted at each packed segment."""
    from areal.engine.kda import chunked_kda, kda_forget_gate, l2_normalize

    g = torch.Generator().manual_seed(0)
    heads, dim, lengths = 2, 8, [37, 1, 70, 5]
    cu = torch.tensor([0, 37, 38, 108, 113])
    q, k, v = (torch.randn(113, heads, dim, generator=g) for _ in range(3))
    decay = kda_forget_gate(torch.randn(113, heads, dim, generator=g),
                            torch.rand(heads, generator=g).log(),
                            torch.randn(heads, dim, generator=g), True, -5.0)  # fmt: skip
    beta = torch.rand(113, heads, generator=g)
    got = chunked_kda(q, k, v, decay, beta, cu)
    expected = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        state = torch.zeros(heads, dim, dim)
        for t in range(start, end):
            # S <- diag(exp g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q
            qt, kt = l2_normalize(q[t]) * dim**-0.5, l2_normalize(k[t])
            state = decay[t].exp().unsqueeze(-1) * state
            u = beta[t, :, None] * (v[t] - torch.einsum("hkv,hk->hv", state, kt))
            state = state + kt.unsqueeze(-1) * u.unsqueeze(-2)
            expected.append(torch.einsum("hkv,hk->hv", state, qt))
    assert len(expected) == sum(lengths)
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-6, rtol=1e-5)


def test_forget_gate_hand_values():
    from areal.engine.kda import kda_forget_gate

    # A = exp(log 2) = 2, x = 0.5 + 0.5 = 1: safe gate -5 * sigmoid(2) = -4.4040;
    # softplus gate -2 * log(1 + e) = -2.6265
    x, a_log, bias = torch.full((1, 1, 1), 0.5), torch.tensor([2.0]).log(), torch.full((1, 1), 0.5)
    safe = kda_forget_gate(x, a_log, bias, True, -5.0)
    soft = kda_forget_gate(x, a_log, bias, False, -5.0)
    assert safe.item() == pytest.approx(-4.4040, abs=1e-4)
    assert soft.item() == pytest.approx(-2.6265, abs=1e-4)


# --- HF -> Megatron on one rank ---


def test_bridge_refuses_settings_it_cannot_reproduce():
    from transformers import BailingHybridConfig

    from areal.engine.megatron_bailing import unsupported_settings

    config = BailingHybridConfig(num_hidden_layers=2, expert_swiglu_limit_list=[0, 7.0],
                                 num_experts_per_tok=8, n_group=8, topk_group=2)  # fmt: skip
    problems = "\n".join(unsupported_settings(config))
    assert "expert_swiglu_limit_list" in problems
    assert "topk_group" in problems
    assert unsupported_settings(BailingHybridConfig(num_hidden_layers=2)) == []


@pytest.fixture(scope="module")
def megatron_run(cpu_shim, bailing_model_dir, tmp_path_factory):
    """Log-probs of the loaded model (several packed micro-batches), a step, an HF export."""
    from areal.api.io_struct import SaveLoadMeta
    from tests.unit.engine.fsdp_worker import fixed_batch, token_mean_nll

    batch = fixed_batch()
    out = tmp_path_factory.mktemp("ling3-export")
    engine = make_engine(bailing_model_dir)
    try:
        from areal.engine.megatron_model import unwrap

        layers = unwrap(engine.model[0]).decoder.layers
        kinds = [type(layer.self_attention).__name__ for layer in layers]
        from megatron.core.transformer import multi_latent_attention

        mla_rope_packed = getattr(
            multi_latent_attention.apply_rotary_pos_emb, "_areal_packed", False
        )
        before = engine.forward_batch(batch)
        long_logp = engine.forward_batch(long_batch())
        exported_before = engine.hf_state_dict()
        stats = engine.train_batch(batch, token_mean_nll, count)
        exported_after = engine.hf_state_dict()
        after = engine.forward_batch(batch)
        engine.save(SaveLoadMeta(path=str(out / "hf"), weight_format="hf", with_optim=False))
        # recover: the distributed checkpoint brings back the weights of this point
        engine.save(SaveLoadMeta(path=str(out / "dcp"), weight_format="dcp", with_optim=True))
        engine.train_batch(batch, token_mean_nll, count)
        moved = engine.forward_batch(batch)
        engine.load(SaveLoadMeta(path=str(out / "dcp"), weight_format="dcp", with_optim=True))
        recovered = engine.forward_batch(batch)
    finally:
        engine.destroy()
    return {
        "batch": batch,
        "kinds": kinds,
        "mla_rope_packed": mla_rope_packed,
        "before": before,
        "after": after,
        "stats": stats,
        "long_logp": long_logp,
        "moved": moved,
        "recovered": recovered,
        "exported_before": exported_before,
        "exported_after": exported_after,
        "hf_dir": out / "hf",
    }


def test_layers_follow_layer_types(megatron_run):
    # MLA takes the engine's host-sync-free packed rotary embedding
    assert megatron_run["mla_rope_packed"]
    assert megatron_run["kinds"] == [
        "KimiDeltaAttention",
        "GatedMLASelfAttention",
        "KimiDeltaAttention",
        "GatedMLASelfAttention",
    ]


@pytest.mark.parametrize("which", ["fixed", "long"])
def test_hf_weights_load_with_matching_log_probs(megatron_run, bailing_model_dir, which):
    """Packed micro-batches (KDA and its convolution restart at every row) score like HF
    scoring one row at a time."""
    batch, got = (
        (megatron_run["batch"], megatron_run["before"])
        if which == "fixed"
        else (long_batch(), megatron_run["long_logp"])
    )
    real = batch["attention_mask"]
    diff = (got[real] - hf_logprobs(bailing_model_dir, batch)[real]).abs().max()
    print(f"ling3 t1 ({which} batch): max |logp diff| vs HF = {diff:.2e}")
    assert diff < LOGP_ATOL, diff
    assert (got[~real] == 0).all()


def test_low_rank_query_variant_matches_hf(cpu_shim, tmp_path):
    from tests.unit.engine.fsdp_worker import fixed_batch

    model_dir = build_q_lora_variant(tmp_path / "q-lora")
    batch = fixed_batch()
    engine = make_engine(model_dir, optimizer=None)
    try:
        got = engine.forward_batch(batch)
    finally:
        engine.destroy()
    real = batch["attention_mask"]
    diff = (got[real] - hf_logprobs(model_dir, batch)[real]).abs().max()
    assert diff < LOGP_ATOL, diff


def test_bf16_model_keeps_the_kda_decay_parameters_in_float32(cpu_shim, bailing_model_dir):
    """As in the checkpoint (and transformers), A_log, dt_bias and the short-convolution
    taps stay float32, loaded without rounding, while the rest computes in bf16."""
    from safetensors.torch import load_file

    from areal.engine.megatron_model import unwrap
    from tests.unit.engine.fsdp_worker import fixed_batch

    on_disk = load_file(str(bailing_model_dir / "model.safetensors"))
    batch = fixed_batch()
    engine = make_engine(bailing_model_dir, optimizer=None, dtype="bfloat16")
    try:
        kda = unwrap(engine.model[0]).decoder.layers[0].self_attention
        assert kda.linear_q.weight.dtype == torch.bfloat16
        checkpoint_names = {"A_log": "A_log", "dt_bias": "dt_bias"} | {
            f"{p}_conv1d": f"{p}_conv1d.weight" for p in "qkv"
        }
        for name, checkpoint_name in checkpoint_names.items():
            param = getattr(kda, name)
            assert param.dtype == torch.float32, name
            assert torch.equal(param, on_disk[f"model.layers.0.attention.{checkpoint_name}"])
        got = engine.forward_batch(batch)
    finally:
        engine.destroy()
    real = batch["attention_mask"]
    # bf16 activations against the fp32 HF model: bf16 rounding, 3e-3 seen
    assert (got[real] - hf_logprobs(bailing_model_dir, batch)[real]).abs().max() < 2e-2


# --- Megatron -> HF ---


def test_export_names_are_the_checkpoint_names(megatron_run, bailing_model_dir):
    from safetensors import safe_open

    with safe_open(str(bailing_model_dir / "model.safetensors"), "pt") as f:
        on_disk = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    exported = megatron_run["exported_before"]
    assert sorted(exported) == sorted(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(exported[name].to(tensor.dtype), tensor), name


def test_trained_export_reloads_into_hf_with_the_engine_log_probs(megatron_run):
    run = megatron_run
    real = run["batch"]["attention_mask"]
    assert run["stats"]["update_successful"] == 1.0
    assert (run["after"][real] - run["before"][real]).abs().max() > 1e-2  # the step moved
    exported = hf_logprobs(run["hf_dir"], run["batch"])
    diff = (exported[real] - run["after"][real]).abs().max()
    print(f"ling3 export round trip: max |logp diff| = {diff:.2e}")
    assert diff < LOGP_ATOL, diff


def test_dcp_checkpoint_recovers_the_weights(megatron_run):
    real = megatron_run["batch"]["attention_mask"]
    after, moved = megatron_run["after"][real], megatron_run["moved"][real]
    assert (moved - after).abs().max() > 1e-2
    torch.testing.assert_close(megatron_run["recovered"][real], after, rtol=0, atol=1e-6)


def test_hf_save_is_an_official_checkpoint(megatron_run, bailing_model_dir):
    import json

    from safetensors.torch import load_file

    hf_dir = megatron_run["hf_dir"]
    assert json.loads((hf_dir / "config.json").read_text()) == json.loads(
        (bailing_model_dir / "config.json").read_text()
    )
    saved = load_file(str(hf_dir / "model.safetensors"))
    assert set(saved) == set(load_file(str(bailing_model_dir / "model.safetensors")))
    for name, tensor in megatron_run["exported_after"].items():
        assert torch.equal(saved[name], tensor), name


# --- tensor and expert parallelism over two gloo ranks ---


@pytest.fixture(scope="module")
def two_rank_runs(bailing_model_dir, tmp_path_factory):
    """Both layouts score, export and take one SGD step; t2 runs sequence-parallel, in one
    micro-batch long enough that both ranks' sequence shards hold real tokens (32-token
    micro-batches, padded to 64, would leave the second shard all padding)."""
    out = tmp_path_factory.mktemp("ling3-ranks")
    return {
        "t2": run_ranks(
            bailing_model_dir, out / "t2.pt", "megatron:d1t2p1", train=True, mb_tokens=1024
        ),
        "e2": run_ranks(
            bailing_model_dir, out / "e2.pt", "megatron:(attn:d2t1p1|ffn:d1t1p1e2)", train=True
        ),
        # experts split over the ranks of the attention's tensor-parallel group: each rank
        # must load its own experts (mbridge alone scattered rank 0's over the group)
        "t2e2": run_ranks(
            bailing_model_dir,
            out / "t2e2.pt",
            "megatron:(attn:d1t2p1|ffn:d1t1p1e2)",
            train=False,
            mb_tokens=1024,
        ),
    }


@pytest.mark.parametrize("layout", ["t2", "e2", "t2e2"])
def test_two_ranks_score_like_hf_and_export_the_checkpoint(
    two_rank_runs, megatron_run, bailing_model_dir, layout
):
    run = two_rank_runs[layout]
    batch = megatron_run["batch"]
    real = batch["attention_mask"]
    diff = (run["logp"][real] - hf_logprobs(bailing_model_dir, batch)[real]).abs().max()
    print(f"ling3 {layout} ({run['parallel']}): max |logp diff| vs HF = {diff:.2e}")
    assert diff < LOGP_ATOL, diff
    # a distributed checkpoint puts every shard back where it was
    torch.testing.assert_close(run["reloaded_logp"], run["logp"], rtol=0, atol=0)
    # the export gathers every shard back into the checkpoint's tensors
    expected = megatron_run["exported_before"]
    assert sorted(run["before"]) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(run["before"][name], tensor), name


def test_tensor_parallel_runs_sequence_parallel(two_rank_runs):
    # Megatron trains MoE layers under tensor parallelism only with sequence parallelism
    assert two_rank_runs["t2"]["sequence_parallel"]
    assert not two_rank_runs["e2"]["sequence_parallel"]


@pytest.mark.parametrize("layout", ["t2", "e2"])
def test_two_rank_step_equals_the_one_rank_step(two_rank_runs, megatron_run, layout):
    """t2 (sequence-parallel: norms, router and MLA down projections sum their gradients
    over both ranks) and e2 (both ranks hold the same batch: d2 for attention) take the
    one-rank SGD step."""
    run, one = two_rank_runs[layout], megatron_run
    assert run["stats"]["update_successful"] == 1.0
    assert run["stats"]["loss"] == pytest.approx(one["stats"]["loss"], rel=1e-5)
    assert run["stats"]["grad_norm"] == pytest.approx(one["stats"]["grad_norm"], rel=1e-5)
    worst = 0.0
    for name, after in one["exported_after"].items():
        update = after - one["exported_before"][name]
        theirs = run["after"][name] - run["before"][name]
        worst = max(worst, float((theirs - update).abs().max()))
    print(f"ling3 {layout} step vs one rank: max |update diff| = {worst:.2e}")
    assert worst < 1e-5


# --- the same step as the FSDP engine ---


@pytest.fixture(scope="module")
def fsdp_step(megatron_run, bailing_model_dir):
    """The FSDP engine's SGD step (lr 1, same micro-batches) under the checkpoint's names."""
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.engine.fsdp_engine import FSDPEngine
    from areal.models.bailing import to_official_state_dict
    from tests.unit.engine.fsdp_worker import token_mean_nll

    config = TrainEngineConfig(
        experiment_name="test",
        trial_name="ling3-fsdp",
        path=str(bailing_model_dir),
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

    def official(state: dict) -> dict:
        return {k: v.clone() for k, v in to_official_state_dict(state).items()}

    return {"before": official(before), "after": official(after), "stats": stats}


def test_train_step_matches_the_fsdp_engine(megatron_run, fsdp_step):
    m_stats, f_stats = megatron_run["stats"], fsdp_step["stats"]
    assert m_stats["num_micro_batches"] == f_stats["num_micro_batches"]
    assert m_stats["loss"] == pytest.approx(f_stats["loss"], rel=1e-5)
    assert m_stats["grad_norm"] == pytest.approx(f_stats["grad_norm"], rel=1e-4)
    m_before, m_after = megatron_run["exported_before"], megatron_run["exported_after"]
    assert set(fsdp_step["after"]) <= set(m_after)
    worst = 0.0
    for name, after in fsdp_step["after"].items():
        f_update = after - fsdp_step["before"][name]
        m_update = m_after[name] - m_before[name]
        worst = max(worst, float((f_update - m_update).abs().max()))
    print(f"ling3 step vs FSDP: max |update diff| = {worst:.2e}")
    assert worst < 1e-5
