"""Schedulers: how the controller gets worker processes and talks to their engines.

A *worker* is a process running the RPC server (``python -m areal.infra.rpc.rpc_server``)
that hosts engines (a train engine rank, a rollout engine). The controller creates
workers per *role* (``actor``, ``rollout``, ``proxy``...), creates engines on them, and
calls engine methods over HTTP.

Controller and workers share the experiment's secret token, which workers read from the
``AREAL_RPC_TOKEN`` environment variable (set by the scheduler, never on a command line).
The token is never sent: every RPC request is signed with it (HMAC-SHA256 over method,
host, path, timestamp, nonce and body digest) and so is every answer, so neither side
acts on a peer that does not hold it; unsigned or stale requests get 401. The wire
format is in :mod:`areal.infra.rpc.auth`. ``RPC_TOKEN_HEADER`` names the header that
carried the token in clear before; it is kept for imports and ignored by servers.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Literal

from areal.api.cli_args import SchedulingSpec, SchedulingStrategy
from areal.infra.rpc.loop import run_sync

__all__ = ["RPC_TOKEN_ENV", "RPC_TOKEN_HEADER", "Job", "Scheduler", "Worker"]

RPC_TOKEN_ENV = "AREAL_RPC_TOKEN"
RPC_TOKEN_HEADER = "X-Areal-Token"  # never sent any more (see the module docstring)


@dataclass
class Worker:
    """One worker process: ``id`` is ``<role>/<index>``; ``worker_ports[0]`` is its RPC port."""

    id: str
    ip: str
    worker_ports: list[str] = field(default_factory=list)
    engine_ports: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.worker_ports[0]}"


@dataclass
class Job:
    role: str
    replicas: int
    tasks: list[SchedulingSpec] = field(default_factory=list)
    scheduling_strategy: SchedulingStrategy | None = None
    secrets: Literal["none", "rollout"] = "none"
    """Which of the run's secrets the role's workers receive besides the RPC token:
    ``"rollout"`` for rollout workers, ``"none"`` for trainers (see
    :mod:`areal.infra.rpc.secret_env`)."""


class Scheduler(abc.ABC):
    """Starts workers and forwards engine calls to them.

    Engine calls are stated once, as coroutines (:meth:`create_engine`,
    :meth:`set_worker_env`, :meth:`async_call_engine`); :meth:`call_engine` is its
    blocking form."""

    @property
    @abc.abstractmethod
    def n_gpus_per_node(self) -> int: ...

    @abc.abstractmethod
    def create_workers(self, job: Job) -> list[str]:
        """Start ``job.replicas`` workers for ``job.role``; returns their ids."""

    @abc.abstractmethod
    def get_workers(self, role: str, timeout: float | None = None) -> list[Worker]:
        """Block until every worker of ``role`` is up, healthy and configured."""

    @abc.abstractmethod
    def delete_workers(self, role: str | None = None, reverse_order: bool = False) -> None:
        """Destroy the engines, then stop the processes (``None``: every role)."""

    @abc.abstractmethod
    def fork_workers(self, role: str, target_role: str, command: str | None = None) -> list[str]:
        """One new worker per worker of ``target_role``, on the same host."""

    @abc.abstractmethod
    async def create_engine(
        self, worker_id: str, engine: str, engine_name: str | None = None, *args, **kwargs
    ) -> Any:
        """Build ``engine`` (``"<module>.<Class>"``, an engine interface's subclass) on
        the worker with ``*args, **kwargs``; returns its name."""

    @abc.abstractmethod
    async def set_worker_env(self, worker_id: str, env: dict[str, str]) -> None:
        """Set environment variables in the worker (before its engines are created)."""

    def call_engine(
        self,
        worker_id: str,
        method: str,
        *args: Any,
        engine_name: str | None = None,
        rpc_meta: dict[str, Any] | None = None,
        http_timeout: float = 7200.0,
        max_retries: int = 3,
        retry_delay: float = 1.0,
        **kwargs: Any,
    ) -> Any:
        """The blocking form of :meth:`async_call_engine` (from any thread but the RPC
        loop's; see :mod:`areal.infra.rpc.loop`)."""
        return run_sync(
            self.async_call_engine(
                worker_id,
                method,
                *args,
                engine_name=engine_name,
                rpc_meta=rpc_meta,
                http_timeout=http_timeout,
                max_retries=max_retries,
                retry_delay=retry_delay,
                **kwargs,
            )
        )

    @abc.abstractmethod
    async def async_call_engine(
        self,
        worker_id: str,
        method: str,
        *args: Any,
        engine_name: str | None = None,
        rpc_meta: dict[str, Any] | None = None,
        http_timeout: float = 7200.0,
        max_retries: int = 3,
        retry_delay: float = 1.0,
        **kwargs: Any,
    ) -> Any:
        """``engine.method(*args, **kwargs)`` on the worker (the engine named
        ``engine_name``, default the worker id); its result. ``rpc_meta``: how the worker
        runs it (``{"broadcast": False}``: no argument broadcast from the DP head);
        ``max_retries`` total attempts on transient failures, ``retry_delay`` the first
        wait. Controllers call this through
        :class:`~areal.infra.rpc.remote_engine.RemoteEngine`, never by hand."""
