"""Trainer side of the NCCL weight-sync GPU test: ``python -m tests.gpu.weight_sync_worker``.

Trains a few steps on GPU 0, broadcasts the weights to the inference server (GPU 1) over
NCCL in buckets, and records the server's greedy output before and after. As the
reference, the server then loads the trainer's weights from disk (an HF checkpoint the
trainer saves): the two deliveries must produce the same greedy output.
"""

from __future__ import annotations

import argparse
import json

import httpx

PROMPT = [11, 42, 7, 99, 3, 58, 21, 64]


def greedy(server: str) -> list[int]:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True},
    }
    return httpx.post(f"http://{server}/generate", json=body, timeout=120).json()["output_ids"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--backend", default="fsdp", choices=["fsdp", "megatron"])
    args = parser.parse_args()

    from areal.api.cli_args import (
        InferenceEngineConfig,
        MicroBatchSpec,
        OptimizerConfig,
        TrainEngineConfig,
    )
    from areal.api.io_struct import SaveLoadMeta, WeightUpdateMeta
    from areal.engine.fsdp_engine import FSDPEngine
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.utils.network import wait_healthy
    from tests.unit.engine.fsdp_worker import fixed_batch, token_mean_nll

    wait_healthy(args.server, timeout=300, what="inference server")
    if args.backend == "megatron":
        from areal.engine.megatron_engine import MegatronEngine as Engine
    else:
        Engine = FSDPEngine  # noqa: N806
    engine = Engine(
        TrainEngineConfig(
            experiment_name="gpu-test",
            trial_name="weight-sync",
            path=args.model,
            dtype="bfloat16",
            mb_spec=MicroBatchSpec(max_tokens_per_mb=256),
            optimizer=OptimizerConfig(lr=1e-3, warmup_steps_proportion=0.0),
        )
    )
    engine.create_process_group()
    engine.initialize()
    rollout = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1"))
    rollout.initialize(addr=args.server)
    buckets = []
    send_bucket = rollout.update_weights_from_distributed

    def counting(meta, specs):
        buckets.append(len(specs))
        return send_bucket(meta, specs)

    rollout.update_weights_from_distributed = counting

    before = greedy(args.server)
    meta = WeightUpdateMeta(type="xccl", weight_chunked_mem_mb=256, gen_n_servers=1)
    engine.connect_engine(rollout, meta)
    for _ in range(3):
        engine.train_batch(
            fixed_batch(), token_mean_nll, lambda mb: mb["loss_mask"].count_nonzero()
        )
    engine.set_version(1)
    engine.update_weights(meta)
    after = greedy(args.server)

    reference_dir = f"{args.work}/reference"
    engine.save(SaveLoadMeta(path=reference_dir, weight_format="hf"))
    loaded = httpx.post(
        f"http://{args.server}/update_weights_from_disk",
        json={"model_path": reference_dir},
        timeout=300,
    )
    loaded.raise_for_status()
    trainer = greedy(args.server)
    with open(args.out, "w") as f:
        json.dump(
            {"before": before, "after": after, "trainer": trainer, "buckets": len(buckets),
             "tensors": sum(buckets)},
            f,
        )  # fmt: skip
    rollout.destroy()
    engine.destroy()


if __name__ == "__main__":
    main()
