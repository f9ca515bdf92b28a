"""Host addresses and free ports."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

__all__ = [
    "NO_DELAY",
    "find_free_port",
    "find_free_ports",
    "gethostip",
    "httpx_transport",
    "wait_healthy",
]

# Socket options for clients that send a request's head and body in two writes (httpx's
# synchronous transport does): without them Nagle's algorithm holds the body until the
# peer acknowledges the head, and a delayed ACK makes every small request take ~40 ms.
NO_DELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def httpx_transport(**kwargs):
    """An ``httpx.HTTPTransport`` with :data:`NO_DELAY` (other keyword arguments pass on)."""
    import httpx

    return httpx.HTTPTransport(socket_options=NO_DELAY, **kwargs)


def gethostip() -> str:
    """This host's outward-facing IP (loopback when there is no route out)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; this picks the route's source
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def find_free_port(host: str = "") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_free_ports(count: int, host: str = "") -> list[int]:
    """``count`` distinct free ports (held open together while choosing)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_healthy(
    address: str,
    process: subprocess.Popen | None = None,
    timeout: float = 600.0,
    what: str = "server",
    on_wait: Callable[[], None] | None = None,
) -> None:
    """Poll ``http://{address}/health`` until it answers 200.

    Raises ``RuntimeError`` when ``process`` exits first and ``TimeoutError`` after
    ``timeout`` seconds; ``on_wait`` runs between polls (e.g. to log progress).
    """
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} {address} exited with code {process.returncode}")
        try:
            if httpx.get(f"http://{address}/health", timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} {address} not healthy after {timeout}s")
        if on_wait is not None:
            on_wait()
        time.sleep(0.2)
