"""The rollout workers of one controller: typed calls to their engines, and their health targets.

Each worker hosts one engine, reached through a
:class:`~areal.infra.rpc.remote_engine.RemoteEngine` of
:class:`~areal.api.engine_api.RolloutWorkerEngine`. A call to every worker at once
(:meth:`RolloutWorkers.on_all`) is gathered on the RPC loop and *watched*: a worker,
server or proxy found dead raises its health error at once instead of waiting for calls
that may never return (a weight update to a frozen server).

Servers are *quiet* while paused for a weight update or busy with one or with a memory
call; the health supervisor then probes them on a path their HTTP process answers alone
(see :mod:`areal.infra.controller.health`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from areal.api.engine_api import RolloutWorkerEngine
from areal.api.scheduler_api import Scheduler, Worker
from areal.infra.controller.health import (
    INFERENCE_SERVER,
    ROLLOUT_PROXY,
    ROLLOUT_WORKER,
    HealthTarget,
)
from areal.infra.rpc.loop import run_sync
from areal.infra.rpc.remote_engine import RemoteEngine

__all__ = ["WATCH_PERIOD", "RolloutWorkers", "WorkerEngine"]

T = TypeVar("T")
WorkerEngine = RemoteEngine[RolloutWorkerEngine]

WATCH_PERIOD = 0.2  # seconds between health looks while waiting on worker calls


class RolloutWorkers:
    """``workers`` and their engines; ``check_health`` raises the error of a dead one."""

    def __init__(
        self, scheduler: Scheduler, workers: list[Worker], check_health: Callable[[], None]
    ):
        self.workers = list(workers)
        self.engines: list[WorkerEngine] = [
            RemoteEngine(scheduler, w.id, RolloutWorkerEngine) for w in self.workers
        ]
        self._check_health = check_health
        self._quiet_lock = threading.Lock()
        self._busy_calls = 0  # weight updates and memory calls being forwarded
        self._paused = False

    # --- calls to every worker ---

    def on_all(self, call: Callable[[WorkerEngine], Awaitable[T]]) -> list[T]:
        """``call(engine)`` on every worker at once; the results in worker order."""
        return self.on_each(lambda index, engine: call(engine))

    def on_each(self, call: Callable[[int, WorkerEngine], Awaitable[T]]) -> list[T]:
        """``call(worker index, engine)`` on every worker at once; the results in order."""
        self._check_health()
        return run_sync(self._watched(call))

    async def _watched(self, call: Callable[[int, WorkerEngine], Awaitable[T]]) -> list[T]:
        tasks = [asyncio.ensure_future(call(i, e)) for i, e in enumerate(self.engines)]
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(
                    pending, timeout=WATCH_PERIOD, return_when=asyncio.FIRST_EXCEPTION
                )
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
                self._check_health()
            return [task.result() for task in tasks]
        finally:
            for task in pending:  # left running, as the worker runs the call anyway
                task.add_done_callback(_observe)

    # --- quiet servers (see the health module) ---

    def quiet(self) -> bool:
        """Whether the servers are paused or busy with a weight update or memory call."""
        with self._quiet_lock:
            return self._paused or self._busy_calls > 0

    def set_paused(self, paused: bool) -> None:
        with self._quiet_lock:
            self._paused = paused

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """The servers are busy with a weight update or memory call meanwhile."""
        with self._quiet_lock:
            self._busy_calls += 1
        try:
            yield
        finally:
            with self._quiet_lock:
                self._busy_calls -= 1

    # --- health targets ---

    def health_targets(self, server_addrs: list[str]) -> list[HealthTarget]:
        """Every worker and its server (worker ``i`` runs ``server_addrs[i]``)."""
        servers = [
            HealthTarget(INFERENCE_SERVER, addr, w.id, "/health", quiet_path="/get_model_info")
            for w, addr in zip(self.workers, server_addrs, strict=True)
        ]
        return servers + [HealthTarget(ROLLOUT_WORKER, w.address, w.id) for w in self.workers]

    def proxy_targets(self, proxy_addrs: list[str]) -> list[HealthTarget]:
        """The proxies: proxy ``i`` (``http://host:port``) is worker ``i``'s."""
        return [
            HealthTarget(ROLLOUT_PROXY, url.split("://", 1)[-1].rstrip("/"), w.id)
            for w, url in zip(self.workers, proxy_addrs)
        ]


def _observe(task: asyncio.Future[Any]) -> None:
    """Mark a left-running call's failure as seen (asyncio would log it as lost)."""
    if not task.cancelled():
        task.exception()
