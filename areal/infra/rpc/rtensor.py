"""``RTensor``: the reference's remote-tensor reference, kept as an import path.

The reference stored RPC result tensors on the producing worker and handed out
``(shard_id, node_addr)`` references that consumers fetched over HTTP. This port sends
every tensor by value (:mod:`areal.infra.rpc.serialization`), so no result ever holds an
``RTensor``: :meth:`RTensor.localize` returns its argument, and code written against the
reference (``RTensor.localize(result)`` before reading tensors) runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

__all__ = ["RTensor"]

T = TypeVar("T")


@dataclass(frozen=True)
class RTensor:
    """Where a tensor would live in the reference: shard ``shard_id`` on ``node_addr``."""

    shard_id: str
    node_addr: str

    @staticmethod
    def localize(value: T) -> T:
        """``value`` with every remote reference fetched: here, ``value`` itself, since
        RPC results already carry their tensors."""
        return value
