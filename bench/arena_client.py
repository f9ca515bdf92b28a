"""Benchmark of the Arena client against a fake Arena served over real HTTP on loopback.

Measures (1) paging a 100,000-row Stream dataset, blocking and async, and (2) 1,500
concurrent ``launch_one_task_result`` calls, each polling until its task is done. Open
connections are counted on the server's port from /proc/net/tcp while the load runs.

Targets: 100k rows in under 5 s; 1,500 concurrent tasks finish with no error on at most
100 open connections.

    .venv/bin/python bench/arena_client.py [--rows 100000] [--tasks 1500] [--polls 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal.utils.table import render_table  # noqa: E402
from examples.swe.arena_client import ArenaOpenAPIClient  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "arena_client.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def established_on_port(port: int) -> int:
    """Server-side ESTABLISHED sockets on ``port`` (one per open client connection)."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01":
                total += 1
    return total


class ConnectionSampler(threading.Thread):
    def __init__(self, port: int, interval: float = 0.005):
        super().__init__(daemon=True)
        self.port, self.interval = port, interval
        self.peak = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.peak = max(self.peak, established_on_port(self.port))
            time.sleep(self.interval)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return self.peak


def start_server(port: int, rows: int, polls: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "bench" / "fake_arena.py"),
            "--port",
            str(port),
            "--rows",
            str(rows),
            "--polls",
            str(polls),
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
            return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("fake Arena did not start")


def bench_dataset(client: ArenaOpenAPIClient, rows: int) -> list[dict]:
    results = []
    start = time.perf_counter()
    got = client.get_all_dataset_rows("bench-stream")
    wall = time.perf_counter() - start
    pages = 1 + -(-rows // client.MAX_DATASET_LIMIT)
    results.append(
        {
            "case": "dataset, blocking",
            "rows": len(got),
            "requests": pages,
            "wall_s": wall,
            "req_per_s": pages / wall,
        }
    )
    assert len(got) == rows

    async def run_async() -> tuple[int, float]:
        start = time.perf_counter()
        got = await client.get_all_dataset_rows_async("bench-stream", concurrency=8)
        wall = time.perf_counter() - start
        await client.aclose()  # this loop's connections must not linger into the next phase
        return len(got), wall

    n, wall = asyncio.run(run_async())
    assert n == rows
    results.append(
        {
            "case": "dataset, async x8",
            "rows": n,
            "requests": pages,
            "wall_s": wall,
            "req_per_s": pages / wall,
        }
    )
    return results


def bench_tasks(client: ArenaOpenAPIClient, tasks: int, polls: int, port: int) -> dict:
    async def run() -> tuple[int, int, float]:
        async def one(i: int):
            return await client.launch_one_task_result(
                "bench-stream", f"row-{i}", "stream-areal-bench", "http://proxy:8000", "k"
            )

        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(i) for i in range(tasks)), return_exceptions=True)
        wall = time.perf_counter() - start
        errors = sum(isinstance(o, BaseException) for o in outcomes)
        done = sum(getattr(o, "score", None) == 0.75 for o in outcomes)
        await client.aclose()
        return done, errors, wall

    sampler = ConnectionSampler(port)
    sampler.start()
    done, errors, wall = asyncio.run(run())
    peak = sampler.stop()
    requests = tasks * (1 + polls)
    return {
        "case": f"{tasks} concurrent tasks",
        "tasks_done": done,
        "errors": errors,
        "requests": requests,
        "wall_s": wall,
        "req_per_s": requests / wall,
        "peak_open_connections": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--tasks", type=int, default=1500)
    parser.add_argument("--polls", type=int, default=3, help="polls per task until DONE")
    parser.add_argument("--poll-interval", type=float, default=0.2)
    parser.add_argument("--max-connections", type=int, default=100)
    args = parser.parse_args()

    port = free_port()
    server = start_server(port, args.rows, args.polls)
    try:
        client = ArenaOpenAPIClient(
            base_url=f"http://127.0.0.1:{port}",
            api_token="bench-token",
            timeout=120.0,
            poll_interval=args.poll_interval,
            request_retries=3,
            max_connections=args.max_connections,
        )
        dataset = bench_dataset(client, args.rows)
        client.close()
        tasks = bench_tasks(client, args.tasks, args.polls, port)
    finally:
        server.terminate()
        server.wait(timeout=10)

    columns = ["case", "rows/tasks", "requests", "wall s", "req/s", "errors", "peak conns"]
    table = [
        [r["case"], r["rows"], r["requests"], r["wall_s"], r["req_per_s"], 0, None] for r in dataset
    ]
    t = tasks
    table.append(
        [
            t["case"],
            t["tasks_done"],
            t["requests"],
            t["wall_s"],
            t["req_per_s"],
            t["errors"],
            t["peak_open_connections"],
        ]
    )
    title = f"Arena client benchmark ({os.cpu_count()} CPUs, fake Arena on loopback)"
    print("\n" + render_table(title, columns, table))
    verdict = {
        "dataset_under_5s": all(r["wall_s"] < 5.0 for r in dataset),
        "tasks_without_error": t["errors"] == 0 and t["tasks_done"] == args.tasks,
        "connections_at_most_100": t["peak_open_connections"] <= 100,
    }
    print("targets:", ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in verdict.items()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "args": vars(args),
                "dataset": dataset,
                "tasks": t,
                "targets": verdict,
                "machine": {"cpus": os.cpu_count()},
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
