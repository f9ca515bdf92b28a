"""Per-step losses of the FSDP and Megatron engines in bf16, from an fp32 checkpoint (GPU).

An 8-layer Qwen2-0.5B-shaped model with random weights saved in fp32; 8 sequences of
512-4096 tokens; four AdamW steps on the same batch per run, gradient clipping 1.0 (and
once off), learning rates 1e-5 and 1e-3. Megatron runs with and without its distributed
optimizer. Megatron keeps its model parameters in bf16 and starts its fp32 main parameters
from them, while FSDP keeps the checkpoint's fp32 values as master weights; at 1e-5 an
update is below half the bf16 spacing of most weights, so the two trajectories part; at
1e-3 they agree. Prints one line per run: ``(loss, grad_norm)`` per step.

    python3 bench/megatron_bf16_trajectory.py | tee bench/results/megatron_bf16_trajectory_h200.txt
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from areal.utils.tiny_model import QWEN2_05B_SHAPE, build_tiny_model  # noqa: E402
from bench.train_engine import make_batch, padded  # noqa: E402


def run(backend: str, model_dir: Path, batch, lr: float, dist_opt: bool = True,
        steps: int = 4, clip: float = 1.0) -> list[tuple[float, float]]:  # fmt: skip
    from areal.api.cli_args import (
        MegatronDDPConfig,
        MegatronEngineConfig,
        MicroBatchSpec,
        OptimizerConfig,
        TrainEngineConfig,
    )

    config = TrainEngineConfig(
        experiment_name="bench",
        trial_name="bf16-trajectory",
        path=str(model_dir),
        dtype="bfloat16",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=40960),
        optimizer=OptimizerConfig(lr=lr, warmup_steps_proportion=0.0, gradient_clipping=clip),
        logprobs_chunk_size=8192,
        megatron=MegatronEngineConfig(ddp=MegatronDDPConfig(use_distributed_optimizer=dist_opt)),
    )
    if backend == "megatron":
        from areal.engine.megatron_engine import MegatronEngine as Engine
    else:
        from areal.engine.fsdp_engine import FSDPEngine as Engine
    engine = Engine(config)
    engine.create_process_group()
    engine.initialize()

    def loss_fn(logp, entropy, mb):
        mask = mb["loss_mask"].bool()
        return -(logp * mask).sum() / mask.sum().clamp(min=1)

    def weight_fn(mb):
        return mb["loss_mask"].count_nonzero()

    out = []
    for _ in range(steps):
        stats = engine.train_batch(batch, loss_fn, weight_fn)
        out.append((round(stats["loss"], 4), round(stats["grad_norm"], 3)))
    engine.destroy()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/megatron_bf16_trajectory.py needs a CUDA GPU")
    shape = {**QWEN2_05B_SHAPE, "num_layers": 8}
    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "m", dtype="float32", seed=0, **shape)
    batch = padded(make_batch(8, 512, 4096, shape["vocab_size"], 0))
    for lr in (1e-5, 1e-3):
        print("lr", lr, "fsdp        ", run("fsdp", model_dir, batch, lr), flush=True)
        print("lr", lr, "megatron    ", run("megatron", model_dir, batch, lr), flush=True)
        print("lr", lr, "megatron-nd ", run("megatron", model_dir, batch, lr, dist_opt=False),
              flush=True)  # fmt: skip
    print("lr 1e-5 noclip fsdp    ", run("fsdp", model_dir, batch, 1e-5, clip=0.0), flush=True)
    print("lr 1e-5 noclip megatron", run("megatron", model_dir, batch, 1e-5, clip=0.0), flush=True)


if __name__ == "__main__":
    main()
