"""The weight-update group over NCCL on one GPU: does the rendezvous meet, with no probe?

``python -m tests.gpu.nccl_group_probe --out result.json`` starts the trainer side
(:func:`areal.utils.nccl_group.init_weight_update_group`, rank 0) and a server rank that
joins as SGLang does (:func:`areal.inference.weight_group.join_weight_update_group`, which
calls PyTorch's ``_new_process_group_helper`` exactly as SGLang's
``init_custom_process_group``) in two processes, then broadcasts one tensor.

On one GPU both ranks share a device, which NCCL refuses when the communicator forms; so
the expected outcome here is: both joins return at once (no collective at init), and the
first broadcast gets as far as NCCL's communicator setup, failing with "Duplicate GPU"
rather than a store timeout. A store-key mismatch would instead time out waiting for the
NCCL id, and a probe collective at init would block the trainer's join. With two GPUs
(``--devices 0 1``) the broadcast must succeed and deliver the tensor bit-exactly.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
import traceback


def _trainer(port: int, device: int, queue: mp.Queue) -> None:
    import torch

    from areal.utils.nccl_group import broadcast, init_weight_update_group

    torch.cuda.set_device(device)
    out: dict = {"role": "trainer"}
    begin = time.monotonic()
    try:
        group = init_weight_update_group(
            backend="nccl",
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name="weight_update_group",
            timeout_s=60,
        )
        out["join_seconds"] = time.monotonic() - begin
        tensor = torch.arange(1024, dtype=torch.bfloat16, device=f"cuda:{device}")
        begin = time.monotonic()
        broadcast(group, tensor, src=0)
        torch.cuda.synchronize()
        out["broadcast"] = "ok"
    except Exception as e:
        out["broadcast"] = f"{type(e).__name__}: {e}"[:2000]
        out["trace"] = traceback.format_exc()[-3000:]
    out["broadcast_seconds"] = time.monotonic() - begin
    queue.put(out)


def _server(port: int, device: int, queue: mp.Queue) -> None:
    import torch

    from areal.inference.weight_group import join_weight_update_group

    torch.cuda.set_device(device)
    out: dict = {"role": "server"}
    begin = time.monotonic()
    try:
        ranks = join_weight_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
            group_name="weight_update_group",
            backend="nccl",
            devices=[torch.device("cuda", device)],
            timeout_s=60,
        )
        out["join_seconds"] = time.monotonic() - begin
        out["ranks"] = ranks.ranks
        begin = time.monotonic()
        [got] = ranks.receive([[1024]], [torch.bfloat16], timeout_s=120)
        expected = torch.arange(1024, dtype=torch.bfloat16, device=got.device)
        out["broadcast"] = "ok" if torch.equal(got, expected) else "wrong values"
    except Exception as e:
        out["broadcast"] = f"{type(e).__name__}: {e}"[:2000]
        out["trace"] = traceback.format_exc()[-3000:]
    out["broadcast_seconds"] = time.monotonic() - begin
    queue.put(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, nargs=2, default=[0, 0])
    args = parser.parse_args()
    from areal.utils.network import find_free_port

    port = find_free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_trainer, args=(port, args.devices[0], queue)),
        ctx.Process(target=_server, args=(port, args.devices[1], queue)),
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=400) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    import torch

    report = {
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "devices": args.devices,
        "results": sorted(results, key=lambda r: r["role"]),
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2)[:6000])


if __name__ == "__main__":
    main()
