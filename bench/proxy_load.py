"""Load on one rollout proxy process in front of a backend that answers at once.

N sessions in flight at once (each slot starts a new one when its session is exported,
until at least --min-total-sessions ran), --repeats runs per level; each session: start
session, 4 chat calls on a growing conversation (concat mode), end session, export.
Reported per N: chat latency p50/p99, chat requests/s, errors, peak RSS of the proxy and
the CPU share of each process. Also the unloaded added latency: one client, sequential
calls, proxy chat versus the backend's /generate directly (interleaved).

Profile the proxy with ``--profile stacks.txt`` (py-spy collapsed stacks; ``.svg`` for a
flame graph).

Targets (this 2-core machine): zero errors at N = 1,500; unloaded added latency p50 under
1.5 ms; at least 800 chat requests/s at N = 100.

    .venv/bin/python bench/proxy_load.py [--sessions 100 1500] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal.utils.http_pool import HTTPPool  # noqa: E402
from areal.utils.network import find_free_ports  # noqa: E402
from areal.utils.table import render_table  # noqa: E402
from areal.utils.tiny_model import build_tokenizer  # noqa: E402
from bench.common import start_service  # noqa: E402

ADMIN = "bench-admin-key-0c1d"
RESULTS = ROOT / "bench" / "results" / "proxy_load.json"


def serving_pid(proc: subprocess.Popen, profiled: bool) -> int:
    """The proxy's own pid: under py-spy, the profiler's only child."""
    if not profiled:
        return proc.pid
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return int(children[0])


def stop(proc: subprocess.Popen, child: int | None = None) -> None:
    """SIGINT makes py-spy write its profile; then the proxy itself is terminated."""
    proc.send_signal(signal.SIGINT if child else signal.SIGTERM)
    proc.wait(timeout=60)
    if child:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGTERM)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Client:
    """JSON calls over keep-alive connections (a light load generator: the proxy is measured)."""

    def __init__(self, address: str):
        self.address = address
        self.pool = HTTPPool()

    async def post(self, path: str, body: dict | None = None, key: str | None = None) -> dict:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        data = orjson.dumps(body if body is not None else {})
        status, raw = await self.pool.request(
            "POST", self.address, path, data, 600, headers=headers
        )
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {raw[:200].decode(errors='replace')}")
        return orjson.loads(raw)

    async def timed_post(self, address: str, path: str, body: dict, key: str | None) -> float:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        begin = time.perf_counter()
        status, _ = await self.pool.request(
            "POST", address, path, orjson.dumps(body), 60, headers=headers
        )
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}")
        return time.perf_counter() - begin


async def session(client: Client, turns: int, latencies: list[float], errors: list[str]) -> int:
    done = 0
    try:
        await client.post("/grant_capacity", key=ADMIN)
        started = await client.post("/rl/start_session", {"task_id": "bench"}, key=ADMIN)
        key = started["api_key"]
        messages = [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Question number one, please answer."},
        ]
        for turn in range(turns):
            begin = time.perf_counter()
            reply = await client.post(
                "/v1/chat/completions",
                {
                    "model": "policy",
                    "messages": messages,
                    "max_tokens": 16,
                    "temperature": 1.0,
                },
                key=key,
            )
            latencies.append(time.perf_counter() - begin)
            done += 1
            messages = [
                *messages,
                reply["choices"][0]["message"],
                {"role": "user", "content": f"Follow-up question {turn + 2}?"},
            ]
        await client.post("/rl/set_reward", {"reward": 1.0}, key=key)
        await client.post("/rl/end_session", key=key)
        exported = await client.post(
            "/export_trajectories",
            {"session_id": started["session_id"], "style": "concat"},
            key=ADMIN,
        )
        if len(exported["interactions"]) != 1:
            errors.append(
                f"export returned {len(exported['interactions'])} trajectories, expected 1"
            )
    except Exception as e:  # counted, never fatal to the benchmark
        errors.append(f"{type(e).__name__}: {e}")
    return done


async def loaded(address: str, sessions: int, turns: int, total: int) -> dict:
    """``sessions`` concurrent slots; each runs sessions back to back until ``total`` ran."""
    latencies: list[float] = []
    errors: list[str] = []
    remaining = [max(total, sessions)]
    client = Client(address)

    async def slot() -> int:
        chats = 0
        while remaining[0] > 0:
            remaining[0] -= 1
            chats += await session(client, turns, latencies, errors)
        return chats

    begin = time.perf_counter()
    chats = sum(await asyncio.gather(*(slot() for _ in range(sessions))))
    wall = time.perf_counter() - begin
    await client.pool.close()
    return {
        "sessions": sessions,
        "total_sessions": max(total, sessions),
        "chats": chats,
        "wall_s": wall,
        "chat_rps": chats / wall,
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "errors": len(errors),
        "error_samples": errors[:5],
    }


async def unloaded(proxy: str, backend: str, calls: int) -> dict:
    client = Client(proxy)
    await client.post("/grant_capacity", key=ADMIN)
    key = (await client.post("/rl/start_session", {"task_id": "unloaded"}, key=ADMIN))["api_key"]
    chat = {
        "model": "policy",
        "max_tokens": 16,
        "temperature": 1.0,
        "store": False,
        "messages": [{"role": "user", "content": "Question number one, please answer."}],
    }
    generate = {
        "input_ids": list(range(20, 50)),
        "return_logprob": True,
        "stream": False,
        "sampling_params": {"max_new_tokens": 16, "temperature": 1.0},
    }
    for _ in range(20):  # warm-up: connections, caches
        await client.timed_post(proxy, "/v1/chat/completions", chat, key)
        await client.timed_post(backend, "/generate", generate, None)
    direct, proxied = [], []
    for _ in range(calls):  # interleaved, so drifts in machine speed hit both alike
        direct.append(await client.timed_post(backend, "/generate", generate, None))
        proxied.append(await client.timed_post(proxy, "/v1/chat/completions", chat, key))
    await client.pool.close()
    return {
        "calls": calls,
        "direct_p50_ms": statistics.median(direct) * 1e3,
        "proxy_p50_ms": statistics.median(proxied) * 1e3,
        "added_p50_ms": (statistics.median(proxied) - statistics.median(direct)) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=[100, 1500])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument(
        "--min-total-sessions",
        type=int,
        default=500,
        help="keep N sessions in flight until at least this many have run",
    )
    parser.add_argument("--unloaded-calls", type=int, default=500)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per load level; the table shows the run with the median req/s",
    )
    parser.add_argument(
        "--profile",
        metavar="PATH",
        default=None,
        help="run the proxy under py-spy; writes collapsed stacks (or a flame graph for *.svg)",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer().save_pretrained(tmp)
        backend_port, proxy_port = find_free_ports(2, "127.0.0.1")
        backend = start_service(
            "fake backend",
            [sys.executable, str(ROOT / "bench" / "fake_sglang.py"), "--port", str(backend_port)],
            backend_port,
        )
        profiler = []
        if args.profile:  # collapsed stacks unless the path asks for an SVG flame graph
            fmt = "flamegraph" if args.profile.endswith(".svg") else "raw"
            profiler = ["py-spy", "record", "--rate", "250", "-f", fmt, "-o", args.profile, "--"]
        proxy = start_service(
            "proxy",
            [
                *profiler,
                sys.executable,
                "-m",
                "areal.proxy.server",
                "--port",
                str(proxy_port),
                "--engine-addr",
                f"127.0.0.1:{backend_port}",
                "--tokenizer-path",
                tmp,
                "--chat-template-type",
                "concat",
                "--engine-max-tokens",
                "4096",
            ],
            proxy_port,
            env={
                "SWE_RL_ADMIN_API_KEY": ADMIN,
                "AREAL_PROXY_WARN_ONCE": "1",
                "AREAL_LOG_LEVEL": "ERROR",
            },
        )
        proxy_pid = serving_pid(proxy, bool(args.profile))
        pids = {"proxy": proxy_pid, "backend": backend.pid, "client": os.getpid()}
        proxy_addr, backend_addr = f"127.0.0.1:{proxy_port}", f"127.0.0.1:{backend_port}"
        try:
            quiet = asyncio.run(unloaded(proxy_addr, backend_addr, args.unloaded_calls))
            levels = []
            for sessions in args.sessions:
                runs = []
                for _ in range(args.repeats):
                    cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
                    run = asyncio.run(
                        loaded(proxy_addr, sessions, args.turns, args.min_total_sessions)
                    )
                    for name, pid in pids.items():  # busy share of one core during the run
                        run[f"{name}_cpu_pct"] = (
                            100 * (cpu_seconds(pid) - cpu[name]) / run["wall_s"]
                        )
                    run["peak_rss_mb"] = peak_rss_mb(proxy_pid)
                    runs.append(run)
                ranked = sorted(runs, key=lambda r: r["chat_rps"])
                level = dict(ranked[len(ranked) // 2])
                level["errors"] = sum(r["errors"] for r in runs)  # errors count over every run
                level["all_chat_rps"] = [r["chat_rps"] for r in runs]
                levels.append(level)
        finally:
            stop(proxy, proxy_pid if args.profile else None)
            stop(backend)

    rows = [
        [
            lv["sessions"],
            lv["total_sessions"],
            lv["chats"],
            lv["wall_s"],
            lv["chat_rps"],
            lv["p50_ms"],
            lv["p99_ms"],
            lv["errors"],
            lv["peak_rss_mb"],
            lv["proxy_cpu_pct"],
            lv["client_cpu_pct"],
            lv["backend_cpu_pct"],
        ]
        for lv in levels
    ]
    columns = [
        "concurrent",
        "sessions",
        "chat calls",
        "wall s",
        "chat req/s",
        "p50 ms",
        "p99 ms",
        "errors",
        "peak RSS MB",
        "proxy CPU %",
        "client CPU %",
        "backend CPU %",
    ]
    print(
        "\n"
        + render_table(
            f"Rollout proxy under load ({os.cpu_count()} CPUs, {args.turns} chat calls "
            "per session, concat mode)",
            columns,
            rows,
        )
    )
    for lv in levels:
        shown = ", ".join(f"{r:.0f}" for r in lv["all_chat_rps"])
        print(
            f"N={lv['sessions']}: chat req/s of the {len(lv['all_chat_rps'])} runs: {shown} "
            f"(errors summed over all runs)"
        )
    print(
        f"\nunloaded, {quiet['calls']} sequential calls: "
        f"backend /generate p50 {quiet['direct_p50_ms']:.2f} ms, "
        f"proxy chat p50 {quiet['proxy_p50_ms']:.2f} ms, added p50 {quiet['added_p50_ms']:.2f} ms"
    )
    by_n = {lv["sessions"]: lv for lv in levels}
    targets = {"added_latency_p50_under_1.5ms": quiet["added_p50_ms"] < 1.5}
    if 100 in by_n:
        targets["rps_at_100_at_least_800"] = by_n[100]["chat_rps"] >= 800
    if 1500 in by_n:
        targets["zero_errors_at_1500"] = by_n[1500]["errors"] == 0
    print("targets:", ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in targets.items()))
    for lv in levels:
        if lv["error_samples"]:
            print(f"errors at N={lv['sessions']}: {lv['error_samples']}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"args": vars(args), "unloaded": quiet, "levels": levels, "targets": targets}, indent=2
        )
        + "\n"
    )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
