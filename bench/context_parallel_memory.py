"""Activation memory per rank under context parallelism, on CPU (gloo).

For each sequence length L and context-parallel size c, c processes each run one forward
and backward of a Qwen-style model (random weights) on their zigzag share of one
L-token sequence (:mod:`areal.engine.context_parallel`, the path the FSDP engine takes under
``fsdp:d1cN``) and count the bytes autograd keeps for the backward pass (every tensor a
``saved_tensors_hooks`` pack sees, each storage counted once): the activation memory of a
step, which is what context parallelism divides. Rank 0's count and the largest over ranks
are printed with the c = 1 count divided by c beside them, then written to
``bench/results/context_parallel_memory.json``.

Keys and values are gathered whole in every attention layer and kept for its backward, so
the count falls somewhat slower than 1/c (the table's last column shows by how much).

    python3 bench/context_parallel_memory.py                 # L 2048 and 8192, c 1, 2, 4
    python3 bench/context_parallel_memory.py --lengths 4096 --sizes 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "context_parallel_memory.json"
SHAPE = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
             intermediate_size=768, vocab_size=2048, max_position_embeddings=65536)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _saved_bytes(run) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` builds the graph."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    loss.backward()
    return sum(seen.values())


def _rank(rank: int, size: int, port: int, model_dir: str, length: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    from transformers import AutoModelForCausalLM

    from areal.engine.attention import packed_forward_kwargs, register_varlen_attention
    from areal.engine.context_parallel import padded_length, plan_shard

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=register_varlen_attention(),
        use_kernels=False,
    )  # fmt: skip
    padded = padded_length(length, size)
    ids = torch.randint(
        3, SHAPE["vocab_size"], (padded,), generator=torch.Generator().manual_seed(0)
    )
    shard = plan_shard(torch.tensor([0, padded]), size, rank, group=dist.group.WORLD)
    kwargs = packed_forward_kwargs(
        shard.local_cu_seqlens,
        int(shard.local_cu_seqlens.diff().max()),
        shard if size > 1 else None,
    )

    def step() -> torch.Tensor:
        logits = model(input_ids=shard.shard(ids)[None], position_ids=shard.positions[None],
                       **kwargs).logits  # fmt: skip
        return logits.float().logsumexp(-1).mean()

    start = time.perf_counter()
    saved = _saved_bytes(step)
    seconds = time.perf_counter() - start
    gathered = [None] * size
    dist.all_gather_object(gathered, {"saved_bytes": saved, "seconds": seconds})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def measure(model_dir: Path, length: int, size: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(_rank, args=(size, _free_port(), str(model_dir), length, out.name), nprocs=size)
        ranks = json.loads(Path(out.name).read_text())
    return {
        "rank0_saved_mb": ranks[0]["saved_bytes"] / 2**20,
        "max_saved_mb": max(r["saved_bytes"] for r in ranks) / 2**20,
        "step_s": max(r["seconds"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--sizes", default="1,2,4")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    from areal.utils.tiny_model import build_tiny_model

    lengths = [int(x) for x in args.lengths.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0, **SHAPE)
        for length in lengths:
            base = None
            for size in sizes:
                r = measure(model_dir, length, size)
                base = r["max_saved_mb"] if size == 1 else base
                ideal = base / size if base else float("nan")
                results.append({"length": length, "c": size, **r, "c1_over_c_mb": ideal})
                ratio = r["max_saved_mb"] / ideal
                rows.append([length, size, f"{r['rank0_saved_mb']:.1f}", f"{r['max_saved_mb']:.1f}",
                             f"{ideal:.1f}", f"{ratio:.2f}", f"{r['step_s']:.2f}"])  # fmt: skip
    header = ["L", "c", "rank 0 MB", "max rank MB", "c1 / c MB", "max / (c1 / c)", "fwd+bwd s"]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    print("Activation memory saved for backward, per rank (CPU, gloo, float32, "
          f"{SHAPE['num_layers']} layers, hidden {SHAPE['hidden_size']})")  # fmt: skip
    for row in (header, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"device": "cpu", "shape": SHAPE, "results": results}, indent=2) + "\n"
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
