"""One gloo rank of a Megatron engine under context parallelism, for multi-rank CPU tests.

``python -m tests.unit.engine.megatron_context_parallel_worker --model DIR --out FILE
--backend megatron:d1p1t1c2 --batch fixed`` (with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` set; one rank runs without them): log-probs of the batch, one SGD step (lr
1, no clipping: the update is minus the gradient) with its loss, gradient norm and the
token-mean entropy and the counts the loss function records, and the HF export before and
after; rank 0 writes them to ``FILE`` with ``torch.save``.
"""

from __future__ import annotations

import argparse

import torch

__all__ = ["BATCHES", "main", "mixed_batch", "nll_with_entropy"]


def mixed_batch() -> dict[str, torch.Tensor]:
    """Long and short rows (70 down to 1 token) that pack into one micro-batch of 256."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([70, 3, 41, 1, 9, 66, 2])
    width = int(lengths.max())
    mask = torch.arange(width)[None] < lengths[:, None]
    ids = torch.randint(3, 120, (len(lengths), width), generator=g) * mask
    loss_mask = mask.clone()
    loss_mask[torch.arange(len(lengths)), lengths - 1] = False
    loss_mask[:, :2] = False
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask.long()}


def _fixed_batch() -> dict[str, torch.Tensor]:
    from tests.unit.engine.fsdp_worker import fixed_batch

    return fixed_batch()


BATCHES = {"fixed": _fixed_batch, "mixed": mixed_batch}


def nll_with_entropy(logp: torch.Tensor, entropy: torch.Tensor, mb: dict) -> torch.Tensor:
    """Token-mean negative log-likelihood; records the token-mean entropy as the actor does,
    and per-sequence statistics (a count and each sequence's summed NLL) that only come out
    as at ``c1`` when the loss sees whole sequences."""
    from areal.utils import stats_tracker
    from areal.utils.packing import unpack_stream

    mask = mb["loss_mask"].bool()
    stats_tracker.denominator(n_loss_tokens=mask)
    stats_tracker.stat(denominator="n_loss_tokens", entropy=entropy.detach().float())
    nll = -(logp * mask).detach().float()
    seq_nll = torch.stack([x.sum() for x in unpack_stream(nll, mb["cu_seqlens"], mb["n_rows"])])
    stats_tracker.denominator(n_loss_seqs=torch.ones_like(seq_nll, dtype=torch.bool))
    stats_tracker.stat(denominator="n_loss_seqs", seq_nll=seq_nll)
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


def count(mb: dict) -> torch.Tensor:
    return mb["loss_mask"].count_nonzero()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--batch", choices=sorted(BATCHES), default="fixed")
    parser.add_argument("--mb-tokens", type=int, default=32)
    args = parser.parse_args()

    from tests.unit.engine import megatron_cpu_shim

    megatron_cpu_shim.apply()
    import torch.distributed as dist

    from areal.api.cli_args import (
        MegatronDDPConfig,
        MegatronEngineConfig,
        MicroBatchSpec,
        OptimizerConfig,
        TrainEngineConfig,
    )
    from areal.engine.megatron_engine import MegatronEngine
    from areal.utils import stats_tracker

    config = TrainEngineConfig(
        experiment_name="test",
        trial_name="context-parallel",
        path=args.model,
        backend=args.backend,
        dtype="float32",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=args.mb_tokens),
        optimizer=OptimizerConfig(type="sgd", lr=1.0, weight_decay=0.0, gradient_clipping=0.0),
        megatron=MegatronEngineConfig(ddp=MegatronDDPConfig(use_distributed_optimizer=False)),
    )
    engine = MegatronEngine(config)
    engine.create_process_group()
    engine.initialize()
    try:
        batch = BATCHES[args.batch]()
        before = engine.hf_state_dict()
        logp = engine.forward_batch(batch)
        # a per-batch count, recorded on every rank as the actor records n_seqs
        stats_tracker.denominator(n_seqs=torch.ones(len(batch["input_ids"]), dtype=torch.bool))
        stats = engine.train_batch(batch, nll_with_entropy, count)
        exported = engine.export_stats()
        after = engine.hf_state_dict()
        if dist.get_rank() == 0:
            torch.save(
                {
                    "logp": logp,
                    "stats": stats,
                    "entropy": exported.get("entropy/avg", exported.get("entropy")),
                    "exported": exported,
                    "before": before,
                    "after": after,
                    "parallel": str(engine.parallel),
                },
                args.out,
            )
    finally:
        engine.destroy()


if __name__ == "__main__":
    main()
