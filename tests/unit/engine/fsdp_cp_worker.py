"""One rank of a context-parallel FSDP engine test: ``python -m tests.unit.engine.fsdp_cp_worker``.

The engine runs ``--backend`` (``fsdp:dXcY``, world size ``X * Y``); the ranks of a
context-parallel group take the same rows of a fixed batch, data-parallel rank ``i`` the
rows ``i::X``. Each rank computes the log-probs of its rows (gathered over the data-parallel
ranks, so rank 0 holds the whole batch's), then trains one SGD step (lr 1, so the update is
exactly the gradient) with a token-mean NLL that records the entropy of the trained tokens
in the stats tracker, and rank 0 writes everything to ``--out``: ``logp``, ``before``,
``state`` (weights before and after), ``stats`` (the step's) and ``tracked`` (the exported
statistics). Run at ``c = 1`` and ``c > 1``, every one of them must agree.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist


def mixed_batch() -> dict[str, torch.Tensor]:
    """Short and long rows, most of them not a multiple of 2c tokens for c = 2 or 4."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([18, 11, 3, 41, 6, 15, 9, 2, 20, 33])
    width = int(lengths.max())
    mask = torch.arange(width)[None] < lengths[:, None]
    ids = torch.randint(3, 120, (len(lengths), width), generator=g) * mask
    loss_mask = mask.clone()
    loss_mask[torch.arange(len(lengths)), lengths - 1] = False  # the last token has no next
    loss_mask[:, :2] = False  # a "prompt" that is not trained
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask.long()}


def token_mean_nll(logp: torch.Tensor, entropy: torch.Tensor, mb: dict) -> torch.Tensor:
    from areal.utils import stats_tracker

    mask = mb["loss_mask"].bool()
    tracker = stats_tracker.get()
    tracker.denominator(n_trained=mask)
    tracker.stat(denominator="n_trained", entropy=entropy.detach().float())
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--mb-tokens", type=int, default=64)
    args = parser.parse_args()

    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.engine.fsdp_engine import FSDPEngine

    config = TrainEngineConfig(
        experiment_name="test",
        trial_name="fsdp-cp-worker",
        path=args.model,
        dtype="float32",
        backend=args.backend,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=args.mb_tokens),
        optimizer=OptimizerConfig(type="sgd", lr=1.0, weight_decay=0.0, gradient_clipping=0.0),
    )
    engine = FSDPEngine(config)
    engine.create_process_group()
    engine.initialize()
    dp_rank, dp = engine.data_parallel_rank, engine.data_parallel_world_size
    batch = {k: v[dp_rank::dp] for k, v in mixed_batch().items()}

    logp = engine.forward_batch(batch)
    parts = [None] * dp
    dist.all_gather_object(parts, logp, group=engine.data_parallel_group)
    full = torch.zeros(mixed_batch()["input_ids"].shape)
    for i, part in enumerate(parts):
        full[i::dp] = part

    before = engine._full_state_dict()
    stats = engine.train_batch(batch, token_mean_nll, lambda mb: mb["loss_mask"].count_nonzero())
    tracked = engine.export_stats()
    state = engine._full_state_dict()
    if dist.get_rank() == 0:
        torch.save(
            {"logp": full, "before": before, "state": state, "stats": stats, "tracked": tracked},
            args.out,
        )
    engine.destroy()


if __name__ == "__main__":
    main()
