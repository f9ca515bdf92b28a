"""One rank of a Megatron (or FSDP) GPU check: ``python -m tests.gpu.megatron_worker``.

Loads ``--model`` with the engine and layout given (``--backend megatron:d1t2p1``), takes
the log-probs of a fixed batch, trains one SGD step, takes them again, optionally exports
HF weights to ``--export``, and rank 0 writes everything to ``--out`` (torch.save).
Run under ``torch.distributed.run`` with as many processes as the layout has ranks.
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="megatron:d1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--mb-tokens", type=int, default=64)
    parser.add_argument("--export", default="")
    args = parser.parse_args()

    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import SaveLoadMeta
    from tests.unit.engine.fsdp_worker import fixed_batch, token_mean_nll

    config = TrainEngineConfig(
        experiment_name="gpu-test",
        trial_name="megatron-worker",
        path=args.model,
        dtype=args.dtype,
        backend=args.backend,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=args.mb_tokens),
        optimizer=OptimizerConfig(type="adam", lr=1e-3, weight_decay=0.0, gradient_clipping=0.0),
    )
    if args.backend.startswith("megatron"):
        from areal.engine.megatron_engine import MegatronEngine

        engine = MegatronEngine(config)
    else:
        from areal.engine.fsdp_engine import FSDPEngine

        engine = FSDPEngine(config)
    engine.create_process_group()
    engine.initialize()
    batch = fixed_batch()

    def count(mb):
        return mb["loss_mask"].count_nonzero()

    before = engine.forward_batch(batch).cpu()
    stats = engine.train_batch(batch, token_mean_nll, count)
    after = engine.forward_batch(batch).cpu()
    if args.export:
        engine.save(SaveLoadMeta(path=args.export, weight_format="hf", with_optim=False))
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"before": before, "after": after, "stats": stats}, args.out)
    engine.destroy()


if __name__ == "__main__":
    main()
