"""One rank of a multi-process FSDP engine test: ``python -m tests.unit.engine.fsdp_worker``.

Each rank trains one SGD step (lr 1, so the update is exactly the gradient) on its share
of a fixed batch, rows ``rank::world``, and rank 0 writes the weights before and after
the step (``before``, ``state``) and the step statistics to ``--out``. Run with world size
1 on the whole batch and with world size 2, the updates must agree: the token-mean loss is
over the global batch.
"""

from __future__ import annotations

import argparse
import os

import torch


def fixed_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor([18, 11, 6, 15, 9, 20])
    width = 20
    mask = torch.arange(width)[None] < lengths[:, None]
    ids = torch.randint(3, 120, (len(lengths), width), generator=g) * mask
    loss_mask = mask.clone()
    loss_mask[torch.arange(len(lengths)), lengths - 1] = False
    loss_mask[:, :3] = False  # a "prompt" that is not trained
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask.long()}


def token_mean_nll(logp: torch.Tensor, entropy: torch.Tensor, mb: dict) -> torch.Tensor:
    mask = mb["loss_mask"].bool()
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mb-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--use-kernels", action="store_true")
    args = parser.parse_args()

    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.engine.fsdp_engine import FSDPEngine

    config = TrainEngineConfig(
        experiment_name="test",
        trial_name="fsdp-worker",
        path=args.model,
        dtype=args.dtype,
        use_kernels=args.use_kernels,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=args.mb_tokens),
        optimizer=OptimizerConfig(type="sgd", lr=1.0, weight_decay=0.0, gradient_clipping=0.0),
    )
    engine = FSDPEngine(config)
    engine.create_process_group()
    engine.initialize()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    batch = {k: v[rank::world] for k, v in fixed_batch().items()}
    before = engine._full_state_dict()
    stats = engine.train_batch(batch, token_mean_nll, lambda mb: mb["loss_mask"].count_nonzero())
    state = engine._full_state_dict()
    if rank == 0:
        torch.save({"before": before, "state": state, "stats": stats}, args.out)
    engine.destroy()


if __name__ == "__main__":
    main()
