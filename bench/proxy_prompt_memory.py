"""Peak memory of one rollout proxy process under concurrent very large prompts.

Starts ``bench/fake_sglang.py`` and ``python -m areal.proxy.server`` as
``RemoteSGLangEngine.launch_proxy`` does (``hf`` chat template, no ``--engine-max-tokens``;
the fake backend reports no context length, so the limit is the default 32,768 tokens),
opens one session per request and sends C chat requests at once, each one user message of
Python source text (the stdlib's ``typing.py`` repeated). Reported per tokenizer (the
shipped ones: SmolLM2-135M-Instruct's and the tiny test tokenizer) and case: the answers'
statuses, the slowest answer, the proxy's resident size before the case and its peak
(``VmHWM``, reset through ``/proc/<pid>/clear_refs`` before each case).

Cases: ``over``, prompts of ``--over-mb`` MB (15: far past a context of 32,768 tokens);
``under``, prompts just under the proxy's prompt-size bound (the most text that could
still fit, so each is rendered and tokenized before its token count refuses it; skipped
where the proxy has no bound). A watchdog kills the proxy past ``--rss-limit-gb``.

    .venv/bin/python bench/proxy_prompt_memory.py [--tokenizers smollm2,tiny] [--concurrency 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal.utils.network import find_free_ports  # noqa: E402
from areal.utils.table import render_table  # noqa: E402
from bench.common import start_service  # noqa: E402

ADMIN = "bench-admin-key-7a2e"
MB = 1_000_000
CONTEXT = 32768  # the proxy's limit: the fake backend reports no context length
RESULTS = ROOT / "bench" / "results" / "proxy_prompt_memory.json"


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} for {pid}")


class Watchdog:
    """Kills ``process`` once its resident memory passes ``limit`` bytes."""

    def __init__(self, process: subprocess.Popen, limit: int):
        self.process, self.limit, self.killed = process, limit, False
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set() and self.process.poll() is None:
            try:
                rss = status_kib(self.process.pid, "VmRSS") * 1024
            except (OSError, RuntimeError):
                return
            if rss > self.limit:
                self.killed = True
                self.process.kill()
                return
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()


def tokenizer_dir(name: str) -> Path:
    if name == "smollm2":
        from areal.utils.smollm2 import smollm2_path

        return smollm2_path()
    from areal.utils.tiny_model import build_tokenizer

    path = Path(tempfile.mkdtemp(prefix="bench-tok-"))
    build_tokenizer().save_pretrained(path)
    return path


def prompt_bytes_bound(path: Path, context: int) -> int | None:
    """The most bytes of one user message the proxy lets through to tokenizing, or None."""
    try:
        from areal.proxy.prompt_size import PromptSizeBound
    except ImportError:
        return None  # a proxy without the bound
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    bound = PromptSizeBound.of(tokenizer)
    if bound is None:
        return None
    empty = [{"role": "user", "content": ""}]
    template = tokenizer.apply_chat_template(empty, tokenize=False, add_generation_prompt=True)
    return bound.max_text_bytes(context) - len(template.encode())  # the template's text counts


def source_text(size: int) -> str:
    source = Path(sysconfig.get_paths()["stdlib"], "typing.py").read_text()
    return (source * (size // len(source) + 1))[:size]


def chat_body(text: str) -> bytes:
    return orjson.dumps(
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    )


async def send_all(url: str, bodies: list[bytes]) -> list[tuple[int, float, str]]:
    async with httpx.AsyncClient(timeout=600) as client:
        keys = []
        for i in range(len(bodies)):
            admin = {"Authorization": f"Bearer {ADMIN}"}
            (await client.post(f"{url}/grant_capacity", headers=admin)).raise_for_status()
            started = await client.post(
                f"{url}/rl/start_session", headers=admin, json={"task_id": f"t{i}"}
            )
            keys.append(started.json()["api_key"])

        async def one(key: str, body: bytes) -> tuple[int, float, str]:
            begin = time.perf_counter()
            try:
                response = await client.post(
                    f"{url}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {key}", "content-type": "application/json"},
                    content=body,
                )
            except httpx.HTTPError as e:
                return 0, time.perf_counter() - begin, type(e).__name__
            return response.status_code, time.perf_counter() - begin, response.text[:200]

        return await asyncio.gather(*(one(k, b) for k, b in zip(keys, bodies, strict=True)))


def run_case(proxy: subprocess.Popen, url: str, size: int, concurrency: int) -> dict:
    Path(f"/proc/{proxy.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    idle = status_kib(proxy.pid, "VmRSS") / 1024
    bodies = [chat_body(source_text(size)) for _ in range(concurrency)]
    begin = time.perf_counter()
    answers = asyncio.run(send_all(url, bodies))
    wall = time.perf_counter() - begin
    alive = proxy.poll() is None
    peak = status_kib(proxy.pid, "VmHWM") / 1024 if alive else float("nan")
    return {
        "prompt_bytes": size,
        "body_bytes": len(bodies[0]),
        "concurrency": concurrency,
        "statuses": [a[0] for a in answers],
        "seconds": [round(a[1], 2) for a in answers],
        "first_answer": answers[0][2],
        "wall_s": round(wall, 2),
        "idle_rss_mb": round(idle),
        "peak_rss_mb": round(peak) if alive else None,
        "proxy_alive": alive,
    }


def measure(name: str, args: argparse.Namespace) -> dict:
    """Every case against one proxy with the tokenizer ``name``."""
    path = tokenizer_dir(name)
    bound = prompt_bytes_bound(path, CONTEXT)
    backend_port, proxy_port = find_free_ports(2)
    env = {"SWE_RL_ADMIN_API_KEY": ADMIN, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    backend = start_service(
        "fake sglang",
        [sys.executable, str(ROOT / "bench" / "fake_sglang.py"), "--port", str(backend_port)],
        backend_port,
    )
    argv = ["--port", str(proxy_port), "--engine-addr", f"127.0.0.1:{backend_port}"]
    argv += ["--tokenizer-path", str(path), "--chat-template-type", "hf"]
    proxy = start_service(
        "proxy", [sys.executable, "-m", "areal.proxy.server", *argv], proxy_port, env
    )
    watchdog = Watchdog(proxy, int(args.rss_limit_gb * 1024**3))
    rows: list[dict] = []
    try:
        for case in args.cases.split(","):
            if case == "under" and bound is None:
                continue  # a proxy without the bound: nothing is "just under" it
            size = int(args.over_mb * MB) if case == "over" else bound
            result = run_case(proxy, f"http://127.0.0.1:{proxy_port}", size, args.concurrency)
            rows.append({"case": case, **result, "killed_over_limit": watchdog.killed})
            if not result["proxy_alive"]:
                break
    finally:
        watchdog.stop()
        for process in (proxy, backend):
            process.terminate()
            process.wait(timeout=30)
    return {"tokenizer": name, "prompt_bound_bytes": bound, "cases": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizers", default="smollm2,tiny", help="smollm2 and/or tiny")
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--over-mb", type=float, default=15.0)
    parser.add_argument("--rss-limit-gb", type=float, default=8.0)
    parser.add_argument("--cases", default="over,under")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    runs = [measure(name, args) for name in args.tokenizers.split(",")]
    table = [
        [
            run["tokenizer"],
            r["case"],
            f"{r['prompt_bytes'] / MB:.2f}",
            r["concurrency"],
            ",".join(map(str, r["statuses"])),
            f"{max(r['seconds']):.2f}",
            r["idle_rss_mb"],
            r["peak_rss_mb"] if r["proxy_alive"] else f"killed > {args.rss_limit_gb:g} GB",
        ]
        for run in runs
        for r in run["cases"]
    ]
    headers = ["tokenizer", "case", "prompt MB", "at once", "statuses", "slowest s"]
    headers += ["idle MB", "peak MB"]
    print(render_table(f"proxy peak memory, context {CONTEXT} tokens", headers, table))
    payload = {"context": CONTEXT, "cpu_count": os.cpu_count(), "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
