"""A mixin for fake schedulers that answer engine calls synchronously."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["SyncEngineCalls"]


class SyncEngineCalls:
    """The awaitable form of a fake's blocking ``call_engine``: it runs on a thread, as a
    real call waits on the network without holding up the RPC loop."""

    def call_engine(self, worker_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def async_call_engine(self, worker_id: str, method: str, *args: Any, **kwargs: Any):
        return await asyncio.to_thread(self.call_engine, worker_id, method, *args, **kwargs)
