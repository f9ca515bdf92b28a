"""A worker's own signed ``/health`` answer, asked directly (not through its scheduler)."""

from __future__ import annotations

import asyncio
from typing import Any

from areal.infra.rpc.client import RPCClient


def signed_health(scheduler: Any, worker: Any) -> dict:
    """``worker``'s signed ``/health`` answer, signed with ``scheduler``'s RPC token."""

    async def ask() -> dict:
        client = RPCClient(
            f"{worker.ip}:{worker.worker_ports[0]}", token=scheduler.rpc_token, worker_id=worker.id
        )
        try:
            return await client.health()
        finally:
            await client.close()

    return asyncio.run(ask())
