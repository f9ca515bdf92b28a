"""A weight-update group join never stalls the embedded server, and it ends in bounded time.

``/init_weights_update_group`` waits on the network: the trainer's rendezvous store, then
its peers. Pointed at an address where nobody listens, the join must fail after the
server's ``--weight-update-group-timeout`` (a 400, as SGLang answers a failed join), other
requests must be served meanwhile, and a SIGTERM during the join must stop the server at
once, not after the join's timeout or the graceful-shutdown window.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from contextlib import suppress

import httpx
import pytest

from areal.inference.engine import GenerationEngine
from areal.inference.server import create_app, main
from areal.utils.serving import GRACEFUL_SHUTDOWN_S
from tests.fakes.live_server import free_port, serve
from tests.helpers.inference_server import server_process

GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}


def dead_join(port: int, group: str = "dead-trainer") -> dict:
    """An init request whose rendezvous address has no listener (the trainer is gone)."""
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": group,
        "backend": "gloo",
    }


def post_in_background(url: str, body: dict, timeout: float) -> tuple[threading.Thread, dict]:
    """POST on a thread; the dict gets ``status``/``json`` or ``error``, and ``seconds``."""
    outcome: dict = {}

    def run() -> None:
        begin = time.monotonic()
        try:
            response = httpx.post(url, json=body, timeout=timeout)
            outcome.update(status=response.status_code, json=response.json())
        except httpx.TransportError as e:  # a closed connection is an answer too
            outcome["error"] = type(e).__name__
        outcome["seconds"] = time.monotonic() - begin

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


BUCKET = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]],
          "group_name": "dead-trainer"}  # fmt: skip


def wait_until_joining(url: str, outcome: dict) -> None:
    """Wait for the server to say the join is under way (a bucket is refused as "still
    being joined"), rather than sleeping and hoping it started."""
    deadline = time.monotonic() + 30
    while True:
        refused = httpx.post(f"{url}/update_weights_from_distributed", json=BUCKET, timeout=10)
        if "still being joined" in refused.text:
            return
        assert time.monotonic() < deadline and not outcome, ("no join under way", outcome)
        time.sleep(0.02)


def timed_generate(url: str) -> tuple[int | str, float]:
    begin = time.monotonic()
    try:
        status: int | str = httpx.post(f"{url}/generate", json=GENERATE, timeout=10).status_code
    except httpx.TransportError as e:
        status = type(e).__name__
    return status, time.monotonic() - begin


def test_generation_goes_on_while_a_join_is_pending(tiny_model_dir):
    engine = GenerationEngine(str(tiny_model_dir), device="cpu").start()  # a 60 s join bound
    try:
        with serve(create_app(engine)) as url:
            join, outcome = post_in_background(
                f"{url}/init_weights_update_group", dead_join(free_port()), timeout=30
            )
            wait_until_joining(url, outcome)
            for _ in range(3):
                status, took = timed_generate(url)
                assert status == 200 and took < 5, f"/generate: {status} after {took:.1f} s"
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            assert join.is_alive(), outcome  # still joining: it had its own 60 s
            engine.begin_shutdown()  # what SIGTERM does: the pending join gives up now
            join.join(timeout=5)
            assert outcome.get("status") == 503, outcome
            assert "shutting down" in outcome["json"]["error"]["message"]
    finally:
        engine.stop()


def test_a_join_to_a_dead_address_fails_after_the_timeout(tiny_model_dir):
    engine = GenerationEngine(str(tiny_model_dir), device="cpu", weight_group_timeout=2.0).start()
    try:
        with serve(create_app(engine)) as url:
            join, outcome = post_in_background(
                f"{url}/init_weights_update_group", dead_join(free_port()), timeout=30
            )
            join.join(timeout=15)
            # SGLang's answer to a failed join: 400 with success false and the reason
            assert outcome.get("status") == 400, outcome
            assert outcome["json"]["success"] is False
            assert "after 2" in outcome["json"]["message"], outcome["json"]["message"]
            assert 1.5 < outcome["seconds"] < 6, outcome["seconds"]
            # the failed join left nothing behind: a bucket finds no group, a rejoin starts
            refused = httpx.post(f"{url}/update_weights_from_distributed", json=BUCKET)
            assert "no weight-update group" in refused.json()["error"]["message"]
            again = httpx.post(
                f"{url}/init_weights_update_group", json=dead_join(free_port()), timeout=30
            )
            assert again.status_code == 400 and again.json()["success"] is False
            assert timed_generate(url)[0] == 200
    finally:
        engine.stop()


def test_a_second_join_of_a_group_being_joined_is_refused(tiny_model_dir):
    engine = GenerationEngine(str(tiny_model_dir), device="cpu", weight_group_timeout=3.0).start()
    try:
        with serve(create_app(engine)) as url:
            first, outcome = post_in_background(
                f"{url}/init_weights_update_group", dead_join(free_port()), timeout=30
            )
            wait_until_joining(url, outcome)
            second = httpx.post(
                f"{url}/init_weights_update_group", json=dead_join(free_port()), timeout=10
            )
            assert second.status_code == 400
            assert "already being joined" in second.json()["error"]["message"]
            refused = httpx.post(f"{url}/update_weights_from_distributed", json=BUCKET)
            assert "still being joined" in refused.json()["error"]["message"]
            first.join(timeout=15)
            assert outcome.get("status") == 400, outcome
    finally:
        engine.stop()


def test_sigterm_during_a_pending_join_exits_at_once(tiny_model_dir):
    with server_process(tiny_model_dir) as (proc, url):
        join, outcome = post_in_background(
            f"{url}/init_weights_update_group", dead_join(free_port()), timeout=60
        )
        wait_until_joining(url, outcome)
        assert join.is_alive(), outcome  # joining (the default bound is 60 s)
        begin = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=GRACEFUL_SHUTDOWN_S + 10)
        took = time.monotonic() - begin if proc.poll() is not None else float("inf")
        join.join(timeout=5)
        # not held for the graceful-shutdown window: the join is abandoned at once
        assert took < GRACEFUL_SHUTDOWN_S - 2, f"exited {took:.1f} s after SIGTERM"
        assert outcome.get("status") == 503 or "error" in outcome, outcome


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_the_timeout_flag_must_be_positive(capsys, value: str):
    with pytest.raises(SystemExit) as exited:  # refused before any model is loaded
        main(["--model-path", "unused", "--weight-update-group-timeout", value])
    assert exited.value.code == 2
    assert "must be > 0 seconds" in capsys.readouterr().err
