"""Run an ASGI app with uvicorn on a background thread (tests, embedded servers)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from areal.utils.network import find_free_port

__all__ = ["GRACEFUL_SHUTDOWN_S", "serve_in_thread"]

# Seconds a server waits for in-flight requests after SIGTERM before closing them: a
# request parked behind a paused generation must not hold a shutdown for minutes.
GRACEFUL_SHUTDOWN_S = 5


@contextmanager
def serve_in_thread(
    app: Any, host: str = "127.0.0.1", port: int | None = None, startup_timeout: float = 30.0
) -> Iterator[str]:
    """Serve ``app`` until the block exits (lifespan included); yields ``http://host:port``."""
    import uvicorn

    port = port or find_free_port(host)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="auto",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"server on {host}:{port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
