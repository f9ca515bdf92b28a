"""``LocalScheduler``: workers as subprocesses of the controller on this machine.

Each worker runs ``python -m areal.infra.rpc.rpc_server`` (or the spec's ``cmd``) in its
own session, with GPUs assigned round-robin through ``CUDA_VISIBLE_DEVICES``, its output
appended to ``{fileroot}/logs/{user}/{exp}/{trial}/{role}.log`` and ``merged.log``, and
its address discovered through name resolution (NFS records), exactly as on Slurm.

The experiment's RPC token (``$AREAL_RPC_TOKEN`` if the controller has one, otherwise a
fresh random one) and the config's secrets reach the workers only through their
environment; they are never on a command line, in a request body or in a log.

Teardown kills whole process trees: ``delete_workers``, the context manager, an
``atexit`` hook and SIGINT/SIGTERM handlers all end every worker and its descendants
(forked workers, inference servers) so that nothing outlives the controller. Roles,
discovery, forking and engine calls are shared with the Slurm scheduler
(:mod:`areal.infra.scheduler.rpc_workers`).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from typing import Any

from areal.api.cli_args import SchedulingSpec
from areal.api.config.scheduling import RPC_SERVER_CMD
from areal.infra.rpc.processes import (
    LoggedProcess,
    kill_process_tree,
    kill_process_trees,
    process_alive,
    read_log_tail,
)
from areal.infra.rpc.secret_env import public_environ
from areal.infra.scheduler.exceptions import (
    GPUAllocationError,
    WorkerCreationError,
    WorkerFailedError,
)
from areal.infra.scheduler.rpc_workers import (
    RPCWorkerScheduler,
    WorkerHandle,
    WorkerRole,
    controller_python_path,
)
from areal.utils import logging

__all__ = ["LocalScheduler"]

logger = logging.getLogger("scheduler.local")

EMERGENCY_GRACE = 3.0  # seconds between SIGTERM and SIGKILL when the controller exits


class LocalScheduler(RPCWorkerScheduler):
    """Starts workers as local subprocesses; see the module docstring.

    ``exp_config`` is the experiment config (``experiment_name``, ``trial_name``,
    ``cluster``, ``seed``); ``gpu_devices`` lists the device ids to hand out (default:
    ``$CUDA_VISIBLE_DEVICES``, else every GPU torch sees).
    """

    # a poll() of a child process or a kill(pid, 0): cheap enough for the RPC loop
    liveness_check_blocks = False

    backend_name = "local scheduler"
    record_root_hint = "any local directory works"

    def __init__(
        self,
        exp_config: Any,
        gpu_devices: list[int | str] | None = None,
        *,
        startup_timeout: float = 300.0,
        stop_grace: float = 10.0,
        destroy_timeout: float = 30.0,
    ):
        self._gpu_devices = None if gpu_devices is None else [str(d) for d in gpu_devices]
        self._gpu_cursor = 0
        self._warned_no_gpu = False
        super().__init__(
            exp_config,
            startup_timeout=startup_timeout,
            stop_grace=stop_grace,
            destroy_timeout=destroy_timeout,
        )

    def worker_pids(self, role: str | None = None) -> dict[str, int]:
        """Process id of every live worker (of ``role``), aliases excluded."""
        with self._lock:
            handles = [h for h in self._handles.values() if role in (None, h.role)]
        pids = {}
        for h in handles:
            pid = h.process.pid if h.process is not None else h.pid
            if pid is not None:
                pids[h.id] = pid
        return pids

    # --- starting processes ---

    def _start_role(
        self, role: str, specs: list[SchedulingSpec], colocate_with: WorkerRole | None
    ) -> list[str]:
        fixed_gpus = None
        if colocate_with is not None:  # the target's devices, no new GPUs
            wids = colocate_with.worker_ids
            fixed_gpus = sorted({g for wid in wids for g in self._gpus_of(wid)}) or None
        handles: list[WorkerHandle] = []
        try:
            for index, spec in enumerate(specs):
                gpus = fixed_gpus if fixed_gpus is not None else self._allocate_gpus(spec, role)
                cmd = self._worker_command(spec, role, index)
                env = self._worker_env(spec, gpus, role)
                worker_id = f"{role}/{index}"
                logger.info(
                    "Starting %s%s: %s",
                    worker_id,
                    f" on GPUs {','.join(gpus)}" if gpus else "",
                    shlex.join(cmd),
                )
                try:
                    process = LoggedProcess(
                        cmd, env, self.log_dir, role, label=worker_id, cwd=os.getcwd()
                    )
                except OSError as e:
                    raise WorkerCreationError(f"cannot start {worker_id}: {e}") from e
                handles.append(
                    WorkerHandle(worker_id, role, index, process=process, gpus=gpus or [])
                )
        except Exception:
            for h in handles:
                h.process.kill_tree(self.stop_grace)
            raise
        self._register_role(WorkerRole(role, "process", [h.id for h in handles], specs[0]), handles)
        return [h.id for h in handles]

    def _worker_command(self, spec: SchedulingSpec, role: str, index: int) -> list[str]:
        cmd = shlex.split(spec.cmd or RPC_SERVER_CMD)
        self._check_worker_cmd(cmd, role)
        if os.path.basename(cmd[0]).startswith("python"):
            cmd[0] = sys.executable  # the controller's interpreter (same venv)
        if not any(a == "--host" or a.startswith("--host=") for a in cmd):
            cmd += ["--host", "127.0.0.1"]
        return [*cmd, "--port", "0", *self._identity_flags(role, index)]

    def _worker_env(
        self, spec: SchedulingSpec, gpus: list[str] | None, role: str
    ) -> dict[str, str]:
        # the controller's environment minus its secrets; the role's own are added below
        env = public_environ()
        env.pop("SLURM_PROCID", None)  # would override --worker-index
        env["PYTHONPATH"] = controller_python_path()
        env["PYTHONUNBUFFERED"] = "1"
        if "OMP_NUM_THREADS" not in env and spec.cpu > 0:
            # the spec's cores bound each worker's torch threads (as torchrun does), so
            # workers sharing a machine do not oversubscribe it
            env["OMP_NUM_THREADS"] = str(min(spec.cpu, os.cpu_count() or spec.cpu))
        for key, value in (spec.env_vars or {}).items():
            env[str(key)] = _expand_vars(str(value), env)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        env.update(self.worker_secrets(role))
        return env

    # --- GPUs ---

    def _devices(self) -> list[str]:
        if self._gpu_devices is None:
            self._gpu_devices = _detect_gpus()
        return self._gpu_devices

    def _allocate_gpus(self, spec: SchedulingSpec, role: str) -> list[str] | None:
        if spec.gpu <= 0:
            return None
        devices = self._devices()
        if not devices:
            if not self._warned_no_gpu:
                logger.warning("Role %s asks for %d GPU(s) but none is visible", role, spec.gpu)
                self._warned_no_gpu = True
            return None
        if spec.gpu > len(devices):
            raise GPUAllocationError(
                f"role {role!r} asks for {spec.gpu} GPUs per worker but this machine has "
                f"{len(devices)} ({','.join(devices)})"
            )
        with self._lock:
            start = self._gpu_cursor
            chosen = [devices[(start + i) % len(devices)] for i in range(spec.gpu)]
            self._gpu_cursor = (start + spec.gpu) % len(devices)
        return chosen

    def _gpus_of(self, worker_id: str) -> list[str]:
        h = self._handle(worker_id)
        return self._gpus_of(h.alias_of) if h.alias_of is not None else h.gpus

    # --- liveness and stopping ---

    def _check_started(self, h: WorkerHandle) -> None:
        if h.process is not None:
            code = h.process.poll()
            if code is not None:
                raise WorkerFailedError(h.id, code, h.process.tail())

    def _check_forked(self, h: WorkerHandle) -> None:
        if h.pid is not None and not process_alive(h.pid):
            raise WorkerFailedError(h.id, None, read_log_tail(self.log_dir / f"{h.role}.log"))

    def _kill_forked(self, h: WorkerHandle) -> None:
        if h.pid is not None and process_alive(h.pid):
            kill_process_tree(h.pid, grace=self.stop_grace)

    def _stop_started(self, r: WorkerRole, handles: list[WorkerHandle]) -> None:
        popens = [h.process.popen for h in handles]
        kill_process_trees([p.pid for p in popens], self.stop_grace, popens)

    def _emergency_stop(self) -> None:
        """Kill every worker tree at once (controller exit or signal); no RPCs, no threads."""
        with self._lock:
            popens = [h.process.popen for h in self._handles.values() if h.process is not None]
            forked = [h.pid for h in self._handles.values() if h.pid is not None]
            self._handles.clear()
            self._roles.clear()
        if popens or forked:
            kill_process_trees([*forked, *(p.pid for p in popens)], EMERGENCY_GRACE, popens)


_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def _expand_vars(value: str, env: dict[str, str]) -> str:
    """``$NAME`` / ``${NAME}`` from ``env`` (unknown names are left as written)."""
    return _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), m.group(0)), value)


def _detect_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no torch, or no driver
        return []
