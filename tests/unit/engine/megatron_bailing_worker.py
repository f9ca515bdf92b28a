"""One gloo rank of a Megatron engine on the tiny Ling 3 model, for multi-rank CPU tests.

``python -m tests.unit.engine.megatron_bailing_worker --model DIR --out FILE --backend
megatron:d1t2`` (with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set): log-probs
of :func:`fixed_batch`, the HF export, the log-probs again after a distributed-checkpoint
save and load, whether the model runs sequence-parallel, and with ``--train`` one SGD step
(lr 1) and the export after it; rank 0 writes them to ``FILE`` with ``torch.save``.
"""

from __future__ import annotations

import argparse

import torch

__all__ = ["main"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--mb-tokens", type=int, default=32)
    parser.add_argument("--train", action="store_true")
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
    from areal.api.io_struct import SaveLoadMeta
    from areal.engine.megatron_engine import MegatronEngine
    from areal.engine.megatron_model import unwrap
    from tests.unit.engine.fsdp_worker import fixed_batch, token_mean_nll

    config = TrainEngineConfig(
        experiment_name="test",
        trial_name="ling3-ranks",
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
        batch = fixed_batch()
        before_state = engine.hf_state_dict()
        logp = engine.forward_batch(batch)
        dcp = SaveLoadMeta(path=f"{args.out}.dcp", weight_format="dcp", with_optim=False)
        engine.save(dcp)
        engine.load(dcp)
        reloaded_logp = engine.forward_batch(batch)
        stats, after_state = None, None
        if args.train:
            stats = engine.train_batch(batch, token_mean_nll, lambda mb: mb["loss_mask"].sum())
            after_state = engine.hf_state_dict()
        if dist.get_rank() == 0:
            torch.save(
                {
                    "logp": logp,
                    "reloaded_logp": reloaded_logp,
                    "stats": stats,
                    "before": before_state,
                    "after": after_state,
                    "parallel": str(engine.parallel),
                    "sequence_parallel": unwrap(engine.model[0]).config.sequence_parallel,
                },
                args.out,
            )
    finally:
        engine.destroy()


if __name__ == "__main__":
    main()
