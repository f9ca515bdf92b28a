"""FSDPEngine on CPU: packing, token-mean over ranks, checkpoints, weight sync over disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from areal.api.cli_args import (
    InferenceEngineConfig,
    MicroBatchSpec,
    OptimizerConfig,
    TrainEngineConfig,
)
from areal.api.io_struct import SaveLoadMeta, WeightUpdateMeta
from areal.engine.fsdp_engine import FSDPEngine
from areal.engine.logprobs import logprobs_from_logits
from areal.utils.network import find_free_port
from tests.unit.engine.fsdp_worker import fixed_batch, token_mean_nll

REPO = Path(__file__).resolve().parents[3]


def make_engine(
    model: Path, mb_tokens: int = 4096, lr: float = 1e-2, use_kernels: bool = False
) -> FSDPEngine:
    config = TrainEngineConfig(
        use_kernels=use_kernels,
        experiment_name="test",
        trial_name="fsdp",
        path=str(model),
        dtype="float32",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=mb_tokens),
        optimizer=OptimizerConfig(lr=lr, warmup_steps_proportion=0.0),
    )
    engine = FSDPEngine(config)
    engine.create_process_group()
    engine.initialize()
    return engine


@pytest.fixture
def engine(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    yield engine
    engine.destroy()


def count(mb: dict) -> torch.Tensor:
    return mb["loss_mask"].count_nonzero()


def unpacked_logprobs(model_dir: Path, batch: dict) -> torch.Tensor:
    """Per-row next-token log-probs from the plain HF model, one row at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for i, row in enumerate(batch["input_ids"]):
            n = int(batch["attention_mask"][i].sum())
            logits = model(input_ids=row[None, :n]).logits[0]
            out[i, : n - 1] = logprobs_from_logits(logits[:-1], row[1:n])
    return out


def test_packed_micro_batches_match_unpacked_rows(tiny_model_dir):
    batch = fixed_batch()
    expected = unpacked_logprobs(tiny_model_dir, batch)
    for mb_tokens in (24, 4096):  # several packed micro-batches, then one
        engine = make_engine(tiny_model_dir, mb_tokens=mb_tokens)
        try:
            got = engine.forward_batch(batch)
        finally:
            engine.destroy()
        real = batch["attention_mask"]
        assert got.shape == expected.shape
        assert torch.allclose(got[real], expected[real], atol=1e-5), (got - expected).abs().max()
        assert (got[~real] == 0).all()


def run_workers(model: Path, out: Path, world: int, mb_tokens: int) -> dict:
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
        }
        argv = [sys.executable, "-m", "tests.unit.engine.fsdp_worker", "--model", str(model),
                "--out", str(out), "--mb-tokens", str(mb_tokens)]  # fmt: skip
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env))
    for proc in procs:
        assert proc.wait(timeout=300) == 0
    return torch.load(out, weights_only=False)


def test_two_gloo_ranks_step_like_one_rank_on_the_whole_batch(tiny_model_dir, tmp_path):
    one = run_workers(tiny_model_dir, tmp_path / "one.pt", world=1, mb_tokens=32)
    two = run_workers(tiny_model_dir, tmp_path / "two.pt", world=2, mb_tokens=32)
    assert one["stats"]["loss"] == pytest.approx(two["stats"]["loss"], rel=1e-6)
    assert one["stats"]["grad_norm"] == pytest.approx(two["stats"]["grad_norm"], rel=1e-5)
    # The updates (after minus before), not the weights, which a wrong step barely moves.
    # SGD at lr 1 moves every tensor by its gradient (update norms of 3e-3 and up); the two
    # layouts agree to float32 rounding (7e-9 seen).
    assert all(torch.equal(one["before"][n], two["before"][n]) for n in one["before"])
    for name, after in one["state"].items():
        update = after - one["before"][name]
        assert update.any(), name  # the step moved it
        assert torch.allclose(two["state"][name] - two["before"][name], update, atol=1e-6), name


def test_training_raises_the_log_prob_of_trained_tokens(engine):
    batch = fixed_batch()
    mask = batch["loss_mask"].bool()
    before = engine.forward_batch(batch)[mask].mean()
    for _ in range(4):
        stats = engine.train_batch(batch, token_mean_nll, count)
        assert stats["update_successful"] == 1.0
    after = engine.forward_batch(batch)[mask].mean()
    assert after > before + 0.5


def test_fused_kernels_give_the_eager_log_probs_and_step(tiny_model_dir):
    """``use_kernels``: compiled decoder layers and log-prob chunks, same numbers as eager.

    mb_tokens=24 makes packed streams of several lengths, so the compiled graphs run on
    dynamic shapes; two train steps and a forward in eval mode exercise both grad modes.
    """
    import torch._dynamo

    batch = fixed_batch()
    mask = batch["loss_mask"].bool()
    results = []
    for use_kernels in (False, True):
        torch.manual_seed(0)
        engine = make_engine(tiny_model_dir, mb_tokens=24, use_kernels=use_kernels)
        try:
            before = engine.forward_batch(batch)
            losses = [engine.train_batch(batch, token_mean_nll, count)["loss"] for _ in range(2)]
            after = engine.forward_batch(batch)
        finally:
            engine.destroy()
        results.append((before, losses, after))
    (eager_before, eager_losses, eager_after), (fused_before, fused_losses, fused_after) = results
    torch.testing.assert_close(fused_before[mask], eager_before[mask], rtol=1e-5, atol=1e-5)
    assert fused_losses == pytest.approx(eager_losses, rel=1e-5)
    torch.testing.assert_close(fused_after[mask], eager_after[mask], rtol=1e-4, atol=1e-4)
    assert (eager_after[mask] - eager_before[mask]).abs().max() > 1e-3  # the step did move
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # something compiled


def test_non_finite_gradients_skip_the_step(engine):
    batch = fixed_batch()
    before = engine._full_state_dict()

    def broken(logp, entropy, mb):
        return token_mean_nll(logp, entropy, mb) * float("nan")

    stats = engine.train_batch(batch, broken, count)
    assert stats["update_successful"] == 0.0
    after = engine._full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_hf_save_reloads_with_the_same_outputs(engine, tmp_path):
    batch = fixed_batch()
    engine.train_batch(batch, token_mean_nll, count)
    engine.save(SaveLoadMeta(path=str(tmp_path / "hf"), weight_format="hf"))
    expected = engine.forward_batch(batch)
    reloaded = unpacked_logprobs(tmp_path / "hf", batch)
    real = batch["attention_mask"]
    assert torch.allclose(expected[real], reloaded[real], atol=1e-5)
    assert (tmp_path / "hf" / "tokenizer.json").exists()


def test_dcp_resume_gives_the_identical_next_step(engine, tmp_path):
    batch = fixed_batch()
    engine.train_batch(batch, token_mean_nll, count)
    engine.lr_scheduler_step()
    engine.save(SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True))
    first = [engine.train_batch(batch, token_mean_nll, count) for _ in range(2)]
    engine.load(SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True))
    again = [engine.train_batch(batch, token_mean_nll, count) for _ in range(2)]
    for a, b in zip(first, again, strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]


def test_disk_weight_update_reaches_the_inference_server(engine, tiny_model_dir, tmp_path):
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.inference.engine import GenerationEngine
    from areal.inference.server import create_app
    from areal.utils.serving import serve_in_thread

    generation = GenerationEngine(str(tiny_model_dir), device="cpu").start()
    prompt = fixed_batch()["input_ids"][0, :6].tolist()

    def served_greedy(url: str) -> list[int]:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        }
        return httpx.post(f"{url}/generate", json=body, timeout=60).json()["output_ids"]

    def trainer_greedy(path: Path) -> list[int]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8
        )
        return out[0, len(prompt) :].tolist()

    try:
        with serve_in_thread(create_app(generation)) as url:
            before = served_greedy(url)
            rollout = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1"))
            rollout.initialize(addr=url.removeprefix("http://"))
            meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "update"))
            engine.connect_engine(rollout, meta)
            for _ in range(6):  # move the weights far enough to change greedy choices
                engine.train_batch(fixed_batch(), token_mean_nll, count)
            engine.set_version(1)
            engine.update_weights(meta)
            after = served_greedy(url)
            rollout.destroy()
        assert after == trainer_greedy(tmp_path / "update")
        assert after != before, "the update did not change the served model"
    finally:
        generation.stop()
