"""Three concurrent 15 MB prompts keep the real proxy process under 1.5 GB.

``python -m areal.proxy.server`` runs the tiny tokenizer in front of a stand-in inference
server that reports a context length of 32,768 tokens (``sglang.context_length``'s
default), which the proxy asks for at start. A prompt of more than 32,766 * 28 bytes of
text cannot fit, so each 15 MB prompt is refused before it is rendered or tokenized;
tokenizing it took 100-150 bytes of memory per byte of text (three such prompts took the
proxy to 5.0 GB with the SmolLM2 tokenizer, ``bench/proxy_prompt_memory.py``).
The peak is the process's ``VmHWM``; a watchdog kills it past 1 GiB.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest

from tests.fakes.live_server import ScriptedASGI, serve
from tests.fakes.scripted_http import ScriptedHTTP, reply
from tests.unit.proxy.conftest import bearer
from tests.unit.proxy.test_hardening_process import Proxy, session_key, start_proxy

MB = 1_000_000
PEAK_LIMIT = 1_500_000_000


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


@pytest.fixture(scope="module")
def proxy(tiny_model_dir) -> Iterator[Proxy]:
    stand_in = (
        ScriptedHTTP()
        .on("GET", "/health", reply(200, {"status": "ok"}))
        .on("GET", "/get_server_info", reply(200, {"context_length": 32768}))
    )
    with serve(ScriptedASGI(stand_in)) as url:
        running = start_proxy(url.removeprefix("http://"), tiny_model_dir)
        yield running
        running.stop()


def test_three_concurrent_15_mb_prompts_stay_under_1_5_gb(proxy):
    keys = [session_key(proxy, f"big-{i}")[1] for i in range(3)]
    body = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "word " * (15 * MB // 5)}]}
    )

    def send(key: str) -> httpx.Response:
        return httpx.post(
            f"{proxy.url}/v1/chat/completions",
            headers={**bearer(key), "content-type": "application/json"},
            content=body,
            timeout=120,
        )

    started = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(send, keys))
    elapsed = time.monotonic() - started
    peak = peak_rss(proxy.process.pid)
    print(f"3 x 15 MB prompts: {elapsed:.1f} s, proxy peak {peak / 1e6:.0f} MB")
    assert not proxy.killed_for_memory and peak < PEAK_LIMIT
    for answer in answers:
        assert answer.status_code == 400, answer.text[:300]
        error = answer.json()["error"]
        assert error["type"] == "context_length_exceeded"
        assert "fewer than 32,767 tokens" in error["message"]
        assert "context length of 32768" in error["message"]
    assert elapsed < 30
    assert httpx.get(f"{proxy.url}/health").status_code == 200
