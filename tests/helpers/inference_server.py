"""A real embedded inference server process (``python -m areal.inference.server``) for tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from areal.inference.auth import API_KEY_ENV
from tests.fakes.live_server import free_port


@contextmanager
def server_process(model_dir: Path | str, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``(process, base URL)`` of a CPU server of ``model_dir`` on loopback without an API
    key, once its ``/health`` answers; killed afterwards if it is still running."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal.inference.server", "--model-path", str(model_dir),
         "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *flags],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")[-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up in 120 s"
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
