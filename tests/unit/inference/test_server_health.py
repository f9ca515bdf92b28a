"""``/health`` of the embedded server reports a frozen generation loop, as SGLang's does."""

from __future__ import annotations

import threading

import httpx

from areal.inference import engine as engine_module
from areal.inference.engine import GenerationEngine
from areal.inference.server import create_app
from tests.fakes.live_server import serve


def test_health_fails_while_the_loop_is_stuck_and_when_it_died(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(engine_module, "STALL_SECONDS", 0.5)
    engine = GenerationEngine(str(tiny_model_dir), device="cpu").start()
    stuck = threading.Event()
    monkeypatch.setattr(engine, "_cmd_wedge", lambda: stuck.wait(30), raising=False)
    with serve(create_app(engine)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        engine.command("wedge")  # a command that never returns: the loop stops turning
        stalled = None
        for _ in range(40):
            response = httpx.get(f"{url}/health")
            if response.status_code == 503:
                stalled = response.json()["error"]["message"]
                break
            threading.Event().wait(0.1)
        assert stalled is not None and "has not turned" in stalled
        stuck.set()  # unstuck: healthy again
        for _ in range(40):
            if httpx.get(f"{url}/health").status_code == 200:
                break
            threading.Event().wait(0.1)
        assert httpx.get(f"{url}/health").status_code == 200
        engine.stop()  # the loop thread is gone
        assert httpx.get(f"{url}/health").status_code == 503
