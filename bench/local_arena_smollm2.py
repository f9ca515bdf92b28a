"""SmolLM2-135M-Instruct on the local Arena's default Streams: what a tiny model scores.

The whole serving path of a training run, on CPU: the embedded inference server
(SmolLM2), the rollout proxy in front of it, and the local Arena. Each task gets its own
proxy session; a route registered with the session's key (``gateway`` route mode)
sends the harness's calls through the Arena gateway to the proxy. Prints, per Stream,
how many tasks ended DONE, the mean score and how many scored above zero.

    .venv/bin/python bench/local_arena_smollm2.py [--streams arith-easy py-funcs] [--limit 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal.utils.network import find_free_ports  # noqa: E402
from areal.utils.smollm2 import smollm2_path  # noqa: E402
from areal.utils.table import render_table  # noqa: E402
from bench.common import start_service  # noqa: E402
from examples.swe.arena_client import ArenaOpenAPIClient, ArenaTaskFailedError  # noqa: E402
from examples.swe.local_arena.testing import running_local_arena  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "local_arena_smollm2.json"
ADMIN = "bench-admin-" + uuid.uuid4().hex[:8]


async def run_task(
    client: ArenaOpenAPIClient, proxy: str, stream: str, data_id: str, sem: asyncio.Semaphore
) -> tuple[str, float | None]:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with sem, httpx.AsyncClient(timeout=600) as http:
        (await http.post(f"{proxy}/grant_capacity", headers=admin)).raise_for_status()
        started = await http.post(
            f"{proxy}/rl/start_session", headers=admin, json={"task_id": data_id}
        )
        started.raise_for_status()
        key = started.json()["api_key"]
        name = f"stream-areal-{uuid.uuid4().hex[:12]}"
        gateway, name = await client.register_llm_proxy_async(name, proxy, key, str(uuid.uuid4()))
        try:
            result = await client.launch_one_task_result(
                stream, data_id, name, gateway, client.llm_gateway_api_key
            )
            outcome = (result.status, result.score)
        except ArenaTaskFailedError as e:
            outcome = (e.status, None)
        finally:
            await client.delete_llm_proxy_async(name)
            await http.post(f"{proxy}/rl/end_session", headers={"Authorization": f"Bearer {key}"})
        return outcome


async def evaluate(arena, proxy: str, streams: list[str], limit: int, concurrency: int) -> dict:
    client = ArenaOpenAPIClient(
        base_url=arena.base_url, api_token=arena.token, llm_api_key=arena.token, poll_interval=0.2
    )
    sem = asyncio.Semaphore(concurrency)
    report = {}
    for stream in streams:
        rows = (await client.get_all_dataset_rows_async(stream))[:limit]
        begin = time.perf_counter()
        outcomes = await asyncio.gather(
            *(run_task(client, proxy, stream, row["data_id"], sem) for row in rows)
        )
        scores = [s for status, s in outcomes if status == "DONE" and s is not None]
        report[stream] = {
            "tasks": len(rows),
            "done": len(scores),
            "statuses": sorted({status for status, _ in outcomes}),
            "mean_score": sum(scores) / len(rows) if rows else 0.0,
            "nonzero": sum(1 for s in scores if s > 0),
            "wall_s": time.perf_counter() - begin,
        }
    await client.aclose()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", nargs="+", default=["arith-easy", "py-funcs"])
    parser.add_argument("--limit", type=int, default=40, help="tasks per Stream")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()

    model = smollm2_path()
    engine_port, proxy_port = find_free_ports(2, "127.0.0.1")
    engine = start_service(
        "inference server",
        [sys.executable, "-m", "areal.inference.server", "--model-path", str(model),
         "--port", str(engine_port), "--device", "cpu"],
        engine_port,
    )  # fmt: skip
    proxy = None
    try:
        proxy = start_service(
            "proxy",
            [sys.executable, "-m", "areal.proxy.server", "--port", str(proxy_port),
             "--engine-addr", f"127.0.0.1:{engine_port}", "--tokenizer-path", str(model),
             "--engine-max-tokens", "2048"],
            proxy_port,
            env={"SWE_RL_ADMIN_API_KEY": ADMIN},
        )  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp, running_local_arena(tmp) as arena:
            report = asyncio.run(
                evaluate(
                    arena, f"http://127.0.0.1:{proxy_port}", args.streams, args.limit,
                    args.concurrency,
                )
            )  # fmt: skip
    finally:
        for process in (proxy, engine):
            if process is not None:
                process.terminate()
                process.wait(timeout=60)

    rows = [
        [
            s,
            r["tasks"],
            r["done"],
            r["nonzero"],
            r["mean_score"],
            r["wall_s"],
            ",".join(r["statuses"]),
        ]
        for s, r in report.items()
    ]
    columns = ["stream", "tasks", "DONE", "score > 0", "mean score", "wall s", "statuses"]
    print(
        "\n"
        + render_table(
            f"SmolLM2-135M-Instruct on the local Arena ({os.cpu_count()} CPUs)", columns, rows
        )
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "streams": report}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
