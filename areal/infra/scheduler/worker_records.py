"""What a scheduler records about its workers and roles, and how worker commands are built."""

from __future__ import annotations

import concurrent.futures
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from areal.api.cli_args import SchedulingSpec
from areal.api.scheduler_api import Worker
from areal.infra.rpc.client import RPCClient
from areal.infra.rpc.processes import LoggedProcess
from areal.infra.rpc.secret_env import SecretScope
from areal.infra.scheduler.exceptions import WorkerConfigurationError

__all__ = ["WorkerHandle", "WorkerRole", "controller_python_path", "module_of", "parallel"]


@dataclass
class WorkerHandle:
    """What a scheduler knows about one worker id."""

    id: str
    role: str
    index: int
    process: LoggedProcess | None = None  # a local subprocess of the controller
    pid: int | None = None  # forked on another worker (its parent is parent_id)
    parent_id: str | None = None
    alias_of: str | None = None  # shares the process of this worker id
    gpus: list[str] = field(default_factory=list)
    client: RPCClient | None = None
    worker: Worker | None = None
    engines: list[str] = field(default_factory=list)


@dataclass
class WorkerRole:
    """A role's workers: ``process`` (started by the backend), ``forked`` or ``alias``."""

    name: str
    kind: Literal["process", "forked", "alias"]
    worker_ids: list[str]
    spec: SchedulingSpec
    target: str | None = None
    ready: list[Worker] | None = None
    secrets: SecretScope = "none"


def parallel(fn: Any, items: list[Any]) -> list[Any]:
    """``[fn(x) for x in items]`` on threads (for blocking process management; RPCs are
    gathered on the RPC loop instead); first error wins."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(min(32, len(items))) as pool:
        return list(pool.map(fn, items))


def module_of(cmd: str | None) -> str | None:
    """The module of a ``python -m <module> ...`` command (None for the default)."""
    if not cmd:
        return None
    parts = shlex.split(cmd)
    if "-m" in parts and parts.index("-m") + 1 < len(parts):
        return parts[parts.index("-m") + 1]
    raise WorkerConfigurationError(
        f"a forked worker runs 'python -m <module>'; cannot fork with cmd {cmd!r}"
    )


def controller_python_path() -> str:
    """``PYTHONPATH`` for workers: the controller's cwd, its ``sys.path``, then the old value.

    Workers can then import whatever the controller imports (example modules included).
    """
    original = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [os.getcwd(), *(p for p in sys.path if p), *original]
    return os.pathsep.join(dict.fromkeys(paths))
