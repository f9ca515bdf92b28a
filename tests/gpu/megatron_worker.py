"""One rank of a Megatron (or FSDP) GPU check: ``python -m tests.gpu.megatron_worker``.

Loads ``--model`` with the engine and layout given (``--backend megatron:d1t2p1``), takes
the log-probs of a fixed batch, trains one SGD step, takes them again, optionally exports
HF weights to ``--export``, and rank 0 writes everything to ``--out`` (torch.save).
Run under ``torch.distributed.run`` with as many processes as the layout has ranks.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def random_batch(lengths: list[int], vocab: int = 1000) -> dict[str, torch.Tensor]:
    """Right-padded rows of random ids in ``[3, vocab)``, every token after the first trained."""
    g = torch.Generator().manual_seed(3)
    width = max(lengths)
    mask = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g) * mask
    loss_mask = mask.clone()
    loss_mask[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = False
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask.long()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="megatron:d1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--mb-tokens", type=int, default=64)
    parser.add_argument("--export", default="")
    parser.add_argument(
        "--lengths",
        default="",
        help="comma-separated row lengths of a random batch (default: the unit tests' fixed batch)",
    )
    parser.add_argument(
        "--kda-torch",
        action="store_true",
        help="KDA layers take the torch recurrence even where flash-linear-attention is installed",
    )
    args = parser.parse_args()
    began = time.perf_counter()

    def phase(what: str) -> None:  # progress with times, so a cut or stuck run shows where
        print(f"[megatron_worker {args.backend}{' kda-torch' if args.kda_torch else ''}] "
              f"{time.perf_counter() - began:7.1f} s: {what}", flush=True)  # fmt: skip

    phase(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}, model {args.model}")
    if os.environ.get("WORKER_TRACEBACK_AFTER"):  # a stuck run shows where it waits
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["WORKER_TRACEBACK_AFTER"]), exit=True)
    if args.kda_torch:
        from areal.engine import kda

        kda.fla_available = lambda: False

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
    phase("engine initialized")
    lengths = [int(n) for n in args.lengths.split(",") if n]
    batch = random_batch(lengths) if lengths else fixed_batch()

    def count(mb):
        return mb["loss_mask"].count_nonzero()

    before = engine.forward_batch(batch).cpu()
    phase("log-probs before the step")
    stats = engine.train_batch(batch, token_mean_nll, count)
    phase(f"trained one step: {stats}")
    after = engine.forward_batch(batch).cpu()
    phase("log-probs after the step")
    if args.export:
        engine.save(SaveLoadMeta(path=args.export, weight_format="hf", with_optim=False))
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"before": before, "after": after, "stats": stats, "batch": batch}, args.out)
    engine.destroy()
    phase("done")


if __name__ == "__main__":
    main()
