"""Host addresses and free ports."""

from __future__ import annotations

import socket

__all__ = ["find_free_port", "find_free_ports", "gethostip"]


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
