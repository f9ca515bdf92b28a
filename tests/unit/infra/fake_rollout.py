"""A killable fake HTTP server and a fake scheduler for RolloutController tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from areal.api.scheduler_api import Job, Worker
from areal.utils.serving import serve_in_thread
from tests.unit.infra.fake_scheduler import SyncEngineCalls

__all__ = ["FakeRolloutScheduler", "FakeServer", "with_dispatch_thread"]


def with_dispatch_thread(start: Callable[[], Any]) -> tuple[Any, threading.Thread]:
    """What ``start()`` returns (a started RolloutController) and the one thread it started
    named ``*-dispatch``: that thread ends by itself when the run fails, and once it has
    ended nothing more can be dispatched (a negative shown without waiting a while)."""
    before = set(threading.enumerate())
    started = start()
    new = [t for t in threading.enumerate() if t not in before and t.name.endswith("-dispatch")]
    assert len(new) == 1, f"expected one new '<role>-dispatch' thread, found {new}"
    return started, new[0]


class FakeServer:
    """Answers ``GET /health`` and ``GET /get_model_info`` with ``status`` after ``delay``
    seconds (per path), or first with the statuses queued in ``next_status``; :meth:`kill`
    closes its port for good."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {"/health": 200, "/get_model_info": 200}
        self.next_status: dict[str, list[int]] = {"/health": [], "/get_model_info": []}
        self.delay: dict[str, float] = {"/health": 0.0, "/get_model_info": 0.0}
        self.hits: list[str] = []
        app = Starlette(
            routes=[
                Route("/health", self._answer, methods=["GET"]),
                Route("/get_model_info", self._answer, methods=["GET"]),
            ]
        )
        self._stack = contextlib.ExitStack()
        url = self._stack.enter_context(serve_in_thread(app))
        self.address = url.removeprefix("http://")

    async def _answer(self, request: Request) -> Response:
        path = request.url.path
        self.hits.append(path)
        queued = self.next_status[path].pop(0) if self.next_status[path] else None
        await asyncio.sleep(self.delay[path])
        status = self.status[path] if queued is None else queued
        return JSONResponse({"status": "ok"}, status_code=status)

    def kill(self) -> None:
        self._stack.close()


class FakeRolloutScheduler(SyncEngineCalls):
    """One rollout worker whose server is ``server_addr``, whose RPC server is
    ``worker_addr`` and whose proxy (once launched) is ``proxy_addr``. A submitted task
    finishes after ``task_seconds`` with ``outcome(data)`` (``None`` = rejected); the
    controller long-polls it (``collect_finished``), as a real worker. While
    ``hold_updates`` is true, weight-update calls wait until ``released`` is set (a frozen
    server)."""

    rpc_token = "fake-token-123456"

    def __init__(
        self,
        server_addr: str,
        worker_addr: str,
        outcome: Callable[[Any], Any] = lambda data: {"row": data},
        task_seconds: float = 0.0,
        proxy_addr: str | None = None,
    ):
        self.server_addr = server_addr
        self.proxy_addr = proxy_addr
        self.worker_host, self.worker_port = worker_addr.rsplit(":", 1)
        self.outcome = outcome
        self.task_seconds = task_seconds
        self.submitted: list[tuple[int, float]] = []  # (task id, monotonic time)
        self.results: dict[int, Any] = {}
        self.hold_updates = False
        self.released = threading.Event()
        self.lock = threading.Lock()

    def create_workers(self, job: Job) -> list[str]:
        return [f"{job.role}/{i}" for i in range(job.replicas)]

    def get_workers(self, role: str, timeout: float | None = None) -> list[Worker]:
        return [Worker(f"{role}/0", self.worker_host, [self.worker_port])]

    async def create_engine(self, worker_id: str, engine: str, *args: Any, **kwargs: Any) -> str:
        return worker_id

    def delete_workers(self, role: str | None = None) -> None:
        pass

    def call_engine(self, worker_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("engine_name", None)
        if method == "launch_local_server":
            return self.server_addr
        if method == "launch_proxy":
            return f"http://{self.proxy_addr}"
        if method == "submit":
            task_id = kwargs["task_id"]
            with self.lock:
                self.submitted.append((task_id, time.monotonic()))
            threading.Thread(target=self._run_task, args=(task_id, args[0]), daemon=True).start()
            return task_id
        if method == "collect_finished":
            return self._collect(*args, **kwargs)
        if method in ("update_weights_from_disk", "begin_weight_update"):
            if self.hold_updates:
                self.released.wait()
            return None
        if method == "export_stats":
            return {}
        return None

    def _run_task(self, task_id: int, data: Any) -> None:
        time.sleep(self.task_seconds)
        with self.lock:
            self.results[task_id] = self.outcome(data)

    def _collect(self, ack: list[int], timeout: float = 1.0) -> list[tuple[int, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                for task_id in ack:
                    self.results.pop(task_id, None)
                ack = []
                if self.results or time.monotonic() >= deadline:
                    return list(self.results.items())
            time.sleep(0.01)
