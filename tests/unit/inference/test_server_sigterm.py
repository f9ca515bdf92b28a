"""The embedded inference server stops promptly on SIGTERM, with a request in flight.

A scheduler (Slurm's ``scancel``, the local scheduler's cleanup) sends SIGTERM and waits a
few seconds before SIGKILL. The server must exit within its graceful-shutdown window
(``GRACEFUL_SHUTDOWN_S``) plus start-up slack even while a long generation runs, and the
client of that generation must get an answer or a closed connection, not a hang.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx

from areal.utils.serving import GRACEFUL_SHUTDOWN_S
from tests.helpers.inference_server import server_process


def test_sigterm_with_a_generation_in_flight_exits_within_the_grace_period(tiny_model_dir):
    with server_process(tiny_model_dir) as (proc, url):
        context = httpx.get(f"{url}/get_server_info", timeout=5).json()["context_length"]
        outcomes: list[dict] = [{} for _ in range(8)]

        def long_generation(outcome: dict) -> None:
            sampling = {"max_new_tokens": context - 4, "ignore_eos": True}
            body = {"input_ids": [1, 2, 3], "sampling_params": sampling}
            try:
                outcome["status"] = httpx.post(f"{url}/generate", json=body, timeout=60).status_code
            except httpx.TransportError as e:
                outcome["error"] = type(e).__name__

        # eight streams to the end of the context: many seconds of decoding on the CPU
        clients = [threading.Thread(target=long_generation, args=(o,), daemon=True)
                   for o in outcomes]  # fmt: skip
        for client in clients:
            client.start()
        deadline = time.monotonic() + 30  # until all eight are decoding (the server says so)
        while httpx.get(f"{url}/get_server_info", timeout=5).json()["running"] < len(clients):
            assert time.monotonic() < deadline and not any(outcomes), outcomes
            time.sleep(0.02)
        assert all(client.is_alive() for client in clients), outcomes
        begin = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=GRACEFUL_SHUTDOWN_S + 10)
        took = time.monotonic() - begin
        for client in clients:
            client.join(timeout=10)
        assert not any(c.is_alive() for c in clients), "a request hung after the server stopped"
        assert all(outcomes), outcomes  # each got an answer or a closed connection
        assert took < GRACEFUL_SHUTDOWN_S + 5, took
