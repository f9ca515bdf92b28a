"""Forking a role's workers beside another role's, through the target workers' ``/fork``.

A mixin of :class:`~areal.infra.scheduler.rpc_workers.RPCWorkerScheduler`: one new worker
beside each target worker, or, for a TP server spanning several target workers' devices,
one beside the first of every ``group`` consecutive target workers, seeing the GPUs of the
whole group (each worker reports what it sees in its signed ``/health`` answer). A forked
worker gets its secrets from a mode-0600 file it removes once read, never from its
parent's environment.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from areal.api.scheduler_api import Worker
from areal.infra.rpc.loop import run_sync
from areal.infra.rpc.secret_env import SECRETS_FILE_ENV
from areal.infra.scheduler.exceptions import (
    RPCConnectionError,
    SchedulerError,
    WorkerCreationError,
    WorkerTimeoutError,
)
from areal.infra.scheduler.worker_records import WorkerHandle, WorkerRole, parallel
from areal.utils import logging

if TYPE_CHECKING:
    pass

__all__ = ["FORK_HEALTH_TIMEOUT", "RPC_SERVER_MODULE", "ForkedWorkers"]

logger = logging.getLogger("scheduler")

RPC_SERVER_MODULE = "areal.infra.rpc.rpc_server"
FORK_HEALTH_TIMEOUT = 60.0


class ForkedWorkers:
    """Forking, for :class:`~areal.infra.scheduler.rpc_workers.RPCWorkerScheduler`
    (which provides the role registry, clients, secrets and liveness checks used here)."""

    def fork_workers(
        self, role: str, target_role: str, command: str | None = None, group: int = 1
    ) -> list[str]:
        """One worker of ``role`` beside each of ``target_role``'s workers, or with
        ``group`` > 1 beside the first of every ``group`` consecutive ones, seeing the
        GPUs of the whole group (a TP server spanning their devices)."""
        self._check_new_role(role)
        target = self._role(target_role)
        target_workers = self.get_workers(target_role)
        if group < 1 or len(target_workers) % group:
            raise WorkerCreationError(
                f"role {role!r}: {len(target_workers)} {target_role} worker(s) do not split "
                f"into groups of {group}"
            )
        module = command or RPC_SERVER_MODULE
        python = self._fork_interpreter(target)
        forked: list[WorkerHandle] = []
        try:
            values = self.worker_secrets(role)
            for index in range(len(target_workers) // group):
                members = target_workers[index * group : (index + 1) * group]
                tw = members[0]
                parent = self._client_of(tw.id)
                port = run_sync(parent.alloc_ports(1))[0]
                raw_cmd = [python, "-m", module, "--host", tw.ip, "--port", str(port)]
                raw_cmd += self._identity_flags(role, index)
                # the child's secrets come from a private file it removes once read, not
                # from its parent's environment
                secrets_file = str(self._write_secrets(f"{role}.{index}", values))
                env = {SECRETS_FILE_ENV: secrets_file}
                devices = self._group_devices(members) if group > 1 else ""
                if devices:
                    env["CUDA_VISIBLE_DEVICES"] = devices
                info = run_sync(parent.fork(role, index, raw_cmd, env=env))
                h = WorkerHandle(
                    f"{role}/{index}", role, index, pid=int(info["pid"]), parent_id=tw.id
                )
                h.client = self._make_client(h, f"{tw.ip}:{port}")
                forked.append(h)
            parallel(self._wait_forked, forked)
            workers = run_sync(self._finish_workers(forked, len(target_workers[0].engine_ports)))
        except Exception:
            parallel(self._stop_forked, forked)
            raise
        r = WorkerRole(role, "forked", [h.id for h in forked], target.spec, target_role, workers)
        self._register_role(r, forked)
        return [h.id for h in forked]

    def _group_devices(self, members: list[Worker]) -> str:
        """The GPUs every worker of ``members`` sees, in order ("" on CPU)."""
        seen: list[str] = []
        for member in members:
            info = run_sync(self._client_of(member.id).health())
            for device in str(info.get("visible_devices") or "").split(","):
                if device and device not in seen:
                    seen.append(device)
        return ",".join(seen)

    def _wait_forked(self, h: WorkerHandle) -> None:
        deadline = time.monotonic() + FORK_HEALTH_TIMEOUT
        while True:
            self._check_alive(h)
            try:
                run_sync(h.client.health(timeout=2.0))
                return
            except RPCConnectionError:
                if time.monotonic() > deadline:
                    raise WorkerTimeoutError(
                        f"forked worker {h.id} not healthy after {FORK_HEALTH_TIMEOUT:.0f}s"
                    ) from None
                time.sleep(0.5)

    def _stop_forked(self, h: WorkerHandle) -> None:
        try:
            run_sync(self._client_of(h.parent_id).kill_forked_worker(h.role, h.index))
        except (SchedulerError, KeyError) as e:
            logger.debug("kill_forked_worker %s via its parent failed: %s", h.id, e)
        self._kill_forked(h)
