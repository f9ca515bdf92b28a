"""MegatronEngine on H200s: HF parity in bf16, FSDP parity, TP=2 and PP=2 steps, HF export.

The model is Qwen3-shaped (hidden 1024, 16 heads / 8 KV heads, vocab 151936, tied
embeddings, 8 layers to keep it quick) with random weights built offline. Every engine run
is a ``torch.distributed.run`` subprocess of :mod:`tests.gpu.megatron_worker`, so each
rank owns its GPU and process groups. Needs megatron-core, mbridge and einops
(``tests/gpu/run_megatron_gpu.sh`` installs them from ``.whl/``).

Bounds (bf16 compute, random weights, log-probs around -log(151936) = -11.9):
* Megatron vs HF log-probs: max |diff| < 0.15, mean |diff| < 0.02; the two stacks round
  bf16 matmuls in different orders (fused QKV / gate-up, RMSNorm placement).
* Megatron vs FSDP, TP=2 and PP=2 vs TP=1: the step's token-mean loss within 1 %.
* HF export vs the trained engine: max |diff| < 0.15 (the same bf16 weights, two stacks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal.utils.tiny_model import build_tiny_model

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
QWEN3_SHAPE = dict(
    arch="qwen3",
    hidden_size=1024,
    num_layers=8,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=3072,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
LOGP_MAX, LOGP_MEAN, LOSS_REL = 0.15, 0.02, 1e-2


def _megatron_importable() -> bool:
    try:
        import mbridge  # noqa: F401
        import megatron.core  # noqa: F401
    except Exception:
        return False
    return True


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


requires_gpu = pytest.mark.skipif(gpus() < 1, reason="needs a CUDA GPU")
requires_two = pytest.mark.skipif(gpus() < 2, reason="needs two CUDA GPUs")
requires_megatron = pytest.mark.skipif(
    not _megatron_importable(), reason="megatron-core / mbridge not importable"
)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen3"), dtype="bfloat16", **QWEN3_SHAPE)


def run(model: Path, out: Path, backend: str, export: Path | None = None) -> dict:
    n = 1
    if backend.startswith("megatron"):
        from areal.api.alloc_mode import ModelAllocation

        n = ModelAllocation.from_str(backend).parallel.world_size
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={n}", "-m", "tests.gpu.megatron_worker", "--model", str(model),
            "--out", str(out), "--backend", backend]  # fmt: skip
    if export is not None:
        argv += ["--export", str(export)]
    subprocess.run(argv, cwd=REPO, env=env, check=True, timeout=500)
    return torch.load(out, weights_only=False)


def hf_logprobs(model_dir: Path, dtype=torch.bfloat16) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from areal.engine.logprobs import logprobs_from_logits
    from tests.unit.engine.fsdp_worker import fixed_batch

    batch = fixed_batch()
    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_kernels=False)
        .cuda()
        .eval()
    )
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for i, row in enumerate(batch["input_ids"]):
            n = int(batch["attention_mask"][i].sum())
            logits = model(input_ids=row[None, :n].cuda()).logits[0].float()
            out[i, : n - 1] = logprobs_from_logits(logits[:-1], row[1:n].cuda()).cpu()
    del model
    torch.cuda.empty_cache()
    return out


def real_positions() -> torch.Tensor:
    from tests.unit.engine.fsdp_worker import fixed_batch

    mask = fixed_batch()["attention_mask"].clone()
    lengths = mask.sum(1)
    mask[torch.arange(len(lengths)), lengths - 1] = False  # the last token scores nothing
    return mask


def assert_close_logp(got: torch.Tensor, expected: torch.Tensor) -> None:
    real = real_positions()
    diff = (got[real] - expected[real]).abs()
    assert diff.max() < LOGP_MAX and diff.mean() < LOGP_MEAN, (diff.max(), diff.mean())


@pytest.fixture(scope="module")
def one_gpu(qwen3, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron-1")
    return {
        "result": run(qwen3, out / "r.pt", "megatron:d1t1p1", export=out / "hf"),
        "export": out / "hf",
    }


@requires_gpu
@requires_megatron
def test_bf16_log_probs_match_hf(qwen3, one_gpu):
    assert_close_logp(one_gpu["result"]["before"], hf_logprobs(qwen3))


@requires_gpu
@requires_megatron
def test_step_loss_matches_fsdp(qwen3, one_gpu, tmp_path):
    fsdp = run(qwen3, tmp_path / "fsdp.pt", "fsdp:d1")
    m, f = one_gpu["result"]["stats"], fsdp["stats"]
    assert m["update_successful"] == 1.0
    assert m["loss"] == pytest.approx(f["loss"], rel=LOSS_REL)
    assert m["grad_norm"] == pytest.approx(f["grad_norm"], rel=5e-2)


@requires_gpu
@requires_megatron
def test_hf_export_reproduces_the_trained_model(one_gpu):
    result = one_gpu["result"]
    real = real_positions()
    assert (result["after"][real] - result["before"][real]).abs().max() > 1e-3
    assert_close_logp(result["after"], hf_logprobs(one_gpu["export"]))


@requires_two
@requires_megatron
@pytest.mark.parametrize("layout", ["megatron:d1t2p1", "megatron:d1t1p2"])
def test_two_gpu_step_matches_one(qwen3, one_gpu, tmp_path, layout):
    two = run(qwen3, tmp_path / "two.pt", layout)
    one = one_gpu["result"]
    assert two["stats"]["update_successful"] == 1.0
    assert two["stats"]["loss"] == pytest.approx(one["stats"]["loss"], rel=LOSS_REL)
    assert_close_logp(two["before"], one["before"])
    assert_close_logp(two["after"], one["after"])


@requires_two
@requires_megatron
def test_two_gpu_data_parallel_step_matches_one(qwen3, one_gpu, tmp_path):
    two = run(qwen3, tmp_path / "dp.pt", "megatron:d2t1p1")
    assert two["stats"]["loss"] == pytest.approx(one_gpu["result"]["stats"]["loss"], rel=LOSS_REL)


QWEN3_MOE_SHAPE = dict(
    arch="qwen3_moe",
    hidden_size=1024,
    num_layers=4,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=768,  # per expert
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)


@requires_gpu
@requires_megatron
def test_moe_log_probs_match_hf_and_export_has_the_step(tmp_path):
    """Qwen3-MoE-shaped (8 experts, top-2) through mbridge: bf16 log-probs vs HF within the
    dense bounds, one step trains, the HF export reproduces the trained model."""
    moe = build_tiny_model(tmp_path / "moe", dtype="bfloat16", **QWEN3_MOE_SHAPE)
    result = run(moe, tmp_path / "moe.pt", "megatron:d1t1p1", export=tmp_path / "hf")
    assert_close_logp(result["before"], hf_logprobs(moe))
    assert result["stats"]["update_successful"] == 1.0
    real = real_positions()
    assert (result["after"][real] - result["before"][real]).abs().max() > 1e-3
    assert_close_logp(result["after"], hf_logprobs(tmp_path / "hf"))
