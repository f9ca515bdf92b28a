"""Throughput of the embedded inference server versus sequential ``model.generate``.

The server runs as its own process (as in production); an aiohttp client keeps
``concurrency`` requests in flight. Every request samples ``--new-tokens`` tokens
(temperature 1, EOS ignored) after a ``--prompt-len``-token prompt. The baseline samples
the same lengths with ``transformers``' ``generate``, one request at a time, in this process.

CPU (tiny model, built offline):   .venv/bin/python bench/inference_server.py
GPU (Qwen2-0.5B-shaped, random):   python3 bench/inference_server.py --device cuda \\
                                       --model qwen2-0.5b --concurrency 1 8 32 64
Target: at concurrency 32 the server produces at least 3x the tokens/s of the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal.utils.network import find_free_port, wait_healthy  # noqa: E402
from areal.utils.table import render_table  # noqa: E402
from areal.utils.tiny_model import QWEN2_05B_SHAPE, build_tiny_model  # noqa: E402


def build_model(kind: str, directory: Path, dtype: str) -> Path:
    if kind == "tiny":
        return build_tiny_model(directory, dtype="float32")
    if kind == "qwen2-0.5b":
        return build_tiny_model(directory, dtype=dtype, **QWEN2_05B_SHAPE)
    return Path(kind)  # a model directory


def start_server(
    model: Path, device: str, dtype: str, max_running: int
) -> tuple[subprocess.Popen, str]:
    port = find_free_port("127.0.0.1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal.inference.server",
            "--model-path",
            str(model),
            "--port",
            str(port),
            "--device",
            device,
            "--dtype",
            dtype,
            "--max-running-requests",
            str(max_running),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"},
    )
    try:
        wait_healthy(f"127.0.0.1:{port}", proc, timeout=600, what="inference server")
    except BaseException:
        proc.kill()
        raise
    return proc, f"http://127.0.0.1:{port}"


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, min(vocab, 1000)) for _ in range(length)] for _ in range(count)]


async def load(
    url: str, concurrency: int, requests: list[list[int]], new_tokens: int
) -> tuple[int, float]:
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    produced = 0

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        nonlocal produced
        body = {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": new_tokens,
                "temperature": 1.0,
                "ignore_eos": True,
            },
        }
        async with gate, session.post(f"{url}/generate", json=body) as response:
            response.raise_for_status()
            produced += len((await response.json())["output_ids"])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await asyncio.gather(*(one(session, p) for p in requests[:concurrency]))  # warm-up
        start = time.perf_counter()
        produced = 0
        await asyncio.gather(*(one(session, p) for p in requests))
        return produced, time.perf_counter() - start


def baseline(
    model_dir: Path, device: str, dtype: str, requests: list[list[int]], new_tokens: int
) -> tuple[int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        .to(device)
        .eval()
    )
    kwargs = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
    )
    with torch.no_grad():
        model.generate(torch.tensor([requests[0]], device=device), **kwargs)  # warm-up
        start = time.perf_counter()
        produced = 0
        for prompt in requests:
            out = model.generate(torch.tensor([prompt], device=device), **kwargs)
            produced += out.shape[1] - len(prompt)
        if device == "cuda":
            torch.cuda.synchronize()
    return produced, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", help="tiny, qwen2-0.5b, or a model directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--rounds", type=int, default=3, help="requests per level = rounds x concurrency"
    )
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--baseline-requests", type=int, default=8)
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/...)")
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.model, Path(tmp) / "model", dtype)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        base_tokens, base_wall = baseline(
            model_dir,
            args.device,
            dtype,
            prompts(args.baseline_requests, args.prompt_len, vocab, 0),
            args.new_tokens,
        )
        base_rate = base_tokens / base_wall
        rows = [
            [
                "sequential generate",
                1,
                args.baseline_requests,
                base_tokens,
                base_wall,
                base_rate,
                1.0,
            ]
        ]
        server, url = start_server(model_dir, args.device, dtype, max(args.concurrency))
        try:
            for concurrency in args.concurrency:
                count = args.rounds * concurrency
                tokens, wall = asyncio.run(
                    load(
                        url,
                        concurrency,
                        prompts(count, args.prompt_len, vocab, concurrency),
                        args.new_tokens,
                    )
                )
                rows.append(
                    [
                        "server",
                        concurrency,
                        count,
                        tokens,
                        wall,
                        tokens / wall,
                        tokens / wall / base_rate,
                    ]
                )
        finally:
            server.terminate()
            server.wait(timeout=30)

    device_name = args.device
    if args.device == "cuda":
        import torch

        device_name = torch.cuda.get_device_name(0)
    title = (
        f"Embedded inference server, {args.model} on {device_name} ({dtype}), prompt "
        f"{args.prompt_len} + {args.new_tokens} new tokens"
    )
    columns = ["mode", "concurrency", "requests", "tokens", "wall s", "tokens/s", "x sequential"]
    print("\n" + render_table(title, columns, rows))
    results = {
        "model": args.model,
        "device": device_name,
        "dtype": dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rows": [
            dict(
                zip(
                    [
                        "mode",
                        "concurrency",
                        "requests",
                        "tokens",
                        "wall_s",
                        "tokens_per_s",
                        "speedup",
                    ],
                    r,
                )
            )
            for r in rows
        ],
    }
    at_32 = [r for r in rows[1:] if r[1] == 32]
    if at_32:
        results["target_3x_at_32"] = at_32[0][6] >= 3.0
        print(
            f"target (>= 3x at concurrency 32): {'met' if results['target_3x_at_32'] else 'MISSED'}"
        )
    out = (
        Path(args.output)
        if args.output
        else ROOT
        / "bench"
        / "results"
        / (f"inference_server_{'gpu' if args.device == 'cuda' else 'cpu'}.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
