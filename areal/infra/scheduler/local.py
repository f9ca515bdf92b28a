"""``LocalScheduler``: workers as subprocesses of the controller on this machine (§10.6).

Each worker runs ``python -m areal.infra.rpc.rpc_server`` (or the spec's ``cmd``) in its
own session, with GPUs assigned round-robin through ``CUDA_VISIBLE_DEVICES``, its output
appended to ``{fileroot}/logs/{user}/{exp}/{trial}/{role}.log`` and ``merged.log``, and
its address discovered through name resolution (NFS records), exactly as on Slurm.

The experiment's RPC token (``$AREAL_RPC_TOKEN`` if the controller has one, otherwise a
fresh random one) reaches the workers only through their environment; it is never on a
command line, in a config payload or in a log.

Teardown kills whole process trees: ``delete_workers``, the context manager, an
``atexit`` hook and SIGINT/SIGTERM handlers all end every worker and its descendants
(forked workers, inference servers) so that nothing outlives the controller.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import re
import secrets
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from areal.api.cli_args import SchedulingSpec
from areal.api.config.scheduling import RPC_SERVER_CMD
from areal.api.scheduler_api import RPC_TOKEN_ENV, Job, Scheduler, Worker
from areal.infra.rpc.client import RPCClient
from areal.infra.rpc.processes import (
    LoggedProcess,
    kill_process_tree,
    kill_process_trees,
    process_alive,
    read_log_tail,
)
from areal.infra.rpc.serialization import SerializationError
from areal.infra.scheduler.exceptions import (
    GPUAllocationError,
    RPCConnectionError,
    SchedulerError,
    WorkerConfigurationError,
    WorkerCreationError,
    WorkerFailedError,
    WorkerNotFoundError,
    WorkerTimeoutError,
)
from areal.utils import logging, name_resolve, names
from areal.utils.config_utils import redact_sensitive_config
from areal.utils.paths import get_log_path
from areal.utils.secrets import SecretStr

__all__ = ["LocalScheduler"]

logger = logging.getLogger("scheduler.local")

RPC_SERVER_MODULE = "areal.infra.rpc.rpc_server"
FORK_HEALTH_TIMEOUT = 60.0
EMERGENCY_GRACE = 3.0  # seconds between SIGTERM and SIGKILL when the controller exits


@dataclass
class _Handle:
    """What the scheduler knows about one worker id."""

    id: str
    role: str
    index: int
    process: LoggedProcess | None = None  # started by this scheduler
    pid: int | None = None  # forked on another worker (its parent is parent_id)
    parent_id: str | None = None
    alias_of: str | None = None  # shares the process of this worker id
    gpus: list[str] = field(default_factory=list)
    client: RPCClient | None = None
    worker: Worker | None = None
    engines: list[str] = field(default_factory=list)


@dataclass
class _Role:
    name: str
    kind: Literal["process", "forked", "alias"]
    worker_ids: list[str]
    spec: SchedulingSpec
    target: str | None = None
    ready: list[Worker] | None = None


class LocalScheduler(Scheduler):
    """Starts workers as local subprocesses; see the module docstring.

    ``exp_config`` is the experiment config (``experiment_name``, ``trial_name``,
    ``cluster``, ``seed``); ``gpu_devices`` lists the device ids to hand out (default:
    ``$CUDA_VISIBLE_DEVICES``, else every GPU torch sees).
    """

    def __init__(
        self,
        exp_config: Any,
        gpu_devices: list[int | str] | None = None,
        *,
        startup_timeout: float = 300.0,
        stop_grace: float = 10.0,
        destroy_timeout: float = 30.0,
    ):
        self.config = exp_config
        self.experiment_name: str = exp_config.experiment_name
        self.trial_name: str = exp_config.trial_name
        cluster = exp_config.cluster
        self.fileroot: str = cluster.fileroot
        self._name_resolve = cluster.name_resolve
        if self._name_resolve.type != "nfs":
            raise SchedulerError(
                f"cluster.name_resolve.type {self._name_resolve.type!r}: the local scheduler "
                "discovers workers through 'nfs' records (any local directory works)"
            )
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.destroy_timeout = destroy_timeout
        self._gpu_devices = None if gpu_devices is None else [str(d) for d in gpu_devices]
        self._gpu_cursor = 0
        self._warned_no_gpu = False
        self._token = SecretStr(os.environ.get(RPC_TOKEN_ENV) or secrets.token_urlsafe(32))
        logging.register_secret(self._token)
        self._roles: dict[str, _Role] = {}
        self._handles: dict[str, _Handle] = {}
        self._lock = threading.RLock()

        name_resolve.reconfigure(self._name_resolve)
        name_resolve.clear_subtree(names.trial_root(self.experiment_name, self.trial_name))
        self.log_dir = get_log_path(self.fileroot, self.experiment_name, self.trial_name)
        _teardown.register(self)

    # --- public helpers ---

    @property
    def n_gpus_per_node(self) -> int:
        return self.config.cluster.n_gpus_per_node

    @property
    def rpc_token(self) -> SecretStr:
        """The token workers expect (for controller-side servers that workers call back)."""
        return self._token

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

    def __enter__(self) -> LocalScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete_workers()

    # --- creating workers ---

    def create_workers(self, job: Job) -> list[str]:
        role = job.role
        self._check_new_role(role)
        if job.replicas < 1:
            raise WorkerCreationError(f"role {role!r}: replicas must be >= 1 (got {job.replicas})")
        specs = self._specs(job)
        strategy = job.scheduling_strategy
        if strategy is not None and strategy.type == "colocation":
            target = self._role(strategy.target)
            if job.replicas == len(target.worker_ids):
                if strategy.fork:
                    return self.fork_workers(role, target.name, _module_of(specs[0].cmd))
                return self._alias(role, target)
            # a different replica count: new processes on the target's devices, no new GPUs
            devices = sorted({g for wid in target.worker_ids for g in self._gpus_of(wid)})
            return self._spawn_role(role, specs, fixed_gpus=devices or None)
        return self._spawn_role(role, specs)

    def _check_new_role(self, role: str) -> None:
        if not role or ":" in role or "/" in role:
            raise WorkerCreationError(f"invalid role name {role!r}: no ':' or '/' allowed")
        with self._lock:
            if role in self._roles:
                raise WorkerCreationError(f"role {role!r} already has workers")

    @staticmethod
    def _specs(job: Job) -> list[SchedulingSpec]:
        tasks = list(job.tasks) or [SchedulingSpec()]
        if len(tasks) == 1:
            return tasks * job.replicas
        if len(tasks) != job.replicas:
            raise WorkerConfigurationError(
                f"role {job.role!r}: {len(tasks)} scheduling specs for {job.replicas} replicas "
                "(give one spec, or one per replica)"
            )
        return tasks

    def _role(self, name: str | None) -> _Role:
        with self._lock:
            role = self._roles.get(name or "")
        if role is None:
            raise WorkerNotFoundError(f"no role {name!r} (known: {sorted(self._roles)})")
        return role

    def _spawn_role(
        self, role: str, specs: list[SchedulingSpec], fixed_gpus: list[str] | None = None
    ) -> list[str]:
        handles: list[_Handle] = []
        try:
            for index, spec in enumerate(specs):
                gpus = fixed_gpus if fixed_gpus is not None else self._allocate_gpus(spec, role)
                cmd = self._worker_command(spec, role, index)
                env = self._worker_env(spec, gpus)
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
                handles.append(_Handle(worker_id, role, index, process=process, gpus=gpus or []))
        except Exception:
            for h in handles:
                h.process.kill_tree(self.stop_grace)
            raise
        with self._lock:
            for h in handles:
                self._handles[h.id] = h
            self._roles[role] = _Role(role, "process", [h.id for h in handles], specs[0])
        return [h.id for h in handles]

    def _worker_command(self, spec: SchedulingSpec, role: str, index: int) -> list[str]:
        cmd = shlex.split(spec.cmd or RPC_SERVER_CMD)
        if not cmd:
            raise WorkerConfigurationError(f"role {role!r}: scheduling spec cmd is empty")
        if any(a == "--port" or a.startswith("--port=") for a in cmd):
            raise WorkerConfigurationError(
                f"role {role!r}: remove --port from the scheduling spec cmd; the scheduler "
                "lets each worker pick a free port and discovers it"
            )
        if os.path.basename(cmd[0]).startswith("python"):
            cmd[0] = sys.executable  # the controller's interpreter (same venv)
        if not any(a == "--host" or a.startswith("--host=") for a in cmd):
            cmd += ["--host", "127.0.0.1"]
        return [*cmd, "--port", "0", *self._identity_flags(role, index)]

    def _identity_flags(self, role: str, index: int) -> list[str]:
        return [
            "--experiment-name",
            self.experiment_name,
            "--trial-name",
            self.trial_name,
            "--role",
            role,
            "--worker-index",
            str(index),
            "--name-resolve-type",
            self._name_resolve.type,
            "--nfs-record-root",
            self._name_resolve.nfs_record_root,
            "--fileroot",
            self.fileroot,
        ]

    def _worker_env(self, spec: SchedulingSpec, gpus: list[str] | None) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("SLURM_PROCID", None)  # would override --worker-index
        original = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        paths = [os.getcwd(), *(p for p in sys.path if p), *original]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["PYTHONUNBUFFERED"] = "1"
        if "OMP_NUM_THREADS" not in env and spec.cpu > 0:
            # the spec's cores bound each worker's torch threads (as torchrun does), so
            # workers sharing a machine do not oversubscribe it
            env["OMP_NUM_THREADS"] = str(min(spec.cpu, os.cpu_count() or spec.cpu))
        for key, value in (spec.env_vars or {}).items():
            env[str(key)] = _expand_vars(str(value), env)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        env[RPC_TOKEN_ENV] = self._token.reveal()
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

    # --- discovery ---

    def get_workers(self, role: str, timeout: float | None = None) -> list[Worker]:
        r = self._role(role)
        if r.ready is not None:
            return list(r.ready)
        if r.kind == "alias":
            targets = self.get_workers(r.target, timeout)
            r.ready = [
                Worker(wid, t.ip, list(t.worker_ports), list(t.engine_ports))
                for wid, t in zip(r.worker_ids, targets)
            ]
            return list(r.ready)
        timeout = timeout if timeout is not None else self.startup_timeout
        deadline = time.monotonic() + timeout
        pending = list(r.worker_ids)
        while pending:
            for worker_id in list(pending):
                if self._discover(self._handles[worker_id]):
                    pending.remove(worker_id)
            if pending:
                if time.monotonic() > deadline:
                    raise WorkerTimeoutError(
                        f"workers {pending} were not up after {timeout:.0f}s; "
                        f"see {self.log_dir / (role + '.log')}"
                    )
                time.sleep(0.1)
        extra_ports = r.spec.port_count - 1
        handles = [self._handles[wid] for wid in r.worker_ids]
        workers = _parallel(lambda h: self._finish_worker(h, extra_ports), handles)
        r.ready = workers
        return list(workers)

    def _discover(self, h: _Handle) -> bool:
        """Whether ``h`` has registered and answers ``/health`` (raises if it died)."""
        self._check_alive(h)
        key = names.worker(self.experiment_name, self.trial_name, h.role, h.index)
        try:
            address = name_resolve.get(key)
        except name_resolve.NameEntryNotFoundError:
            return False
        client = self._make_client(h, address)
        try:
            client.health(timeout=2.0)
        except RPCConnectionError:
            client.close()
            return False
        h.client = client
        return True

    def _make_client(self, h: _Handle, address: str) -> RPCClient:
        return RPCClient(
            address, token=self._token, worker_id=h.id, liveness_check=lambda: self._check_alive(h)
        )

    def _finish_worker(self, h: _Handle, extra_ports: int) -> Worker:
        """Reserve the extra ports and configure the worker; its ``Worker`` record."""
        assert h.client is not None
        ip, port = h.client.address.rsplit(":", 1)
        extra = [str(p) for p in h.client.alloc_ports(extra_ports)] if extra_ports > 0 else []
        try:
            h.client.configure(self.config, h.role, h.index)
        except SerializationError:
            # a config class outside the allowlisted packages: send its fields as a dict
            h.client.configure(redact_sensitive_config(self.config), h.role, h.index)
        h.worker = Worker(h.id, ip, [port, *extra], extra)
        return h.worker

    def _check_alive(self, h: _Handle) -> None:
        if h.alias_of is not None:
            self._check_alive(self._handles[h.alias_of])
            return
        if h.process is not None:
            code = h.process.poll()
            if code is not None:
                raise WorkerFailedError(h.id, code, h.process.tail())
        elif h.pid is not None and not process_alive(h.pid):
            raise WorkerFailedError(h.id, None, read_log_tail(self.log_dir / f"{h.role}.log"))

    def _alias(self, role: str, target: _Role) -> list[str]:
        ids = [f"{role}/{i}" for i in range(len(target.worker_ids))]
        with self._lock:
            for i, (wid, target_id) in enumerate(zip(ids, target.worker_ids)):
                self._handles[wid] = _Handle(wid, role, i, alias_of=target_id)
            self._roles[role] = _Role(role, "alias", ids, target.spec, target=target.name)
        return ids

    # --- forking ---

    def fork_workers(self, role: str, target_role: str, command: str | None = None) -> list[str]:
        self._check_new_role(role)
        target = self._role(target_role)
        target_workers = self.get_workers(target_role)
        module = command or RPC_SERVER_MODULE
        forked: list[_Handle] = []
        try:
            for index, tw in enumerate(target_workers):
                parent = self._client_of(tw.id)
                port = parent.alloc_ports(1)[0]
                raw_cmd = [sys.executable, "-m", module, "--host", tw.ip, "--port", str(port)]
                raw_cmd += self._identity_flags(role, index)
                info = parent.fork(role, index, raw_cmd)
                h = _Handle(f"{role}/{index}", role, index, pid=int(info["pid"]), parent_id=tw.id)
                h.client = self._make_client(h, f"{tw.ip}:{port}")
                forked.append(h)
            _parallel(self._wait_forked, forked)
            n_extra = len(target_workers[0].engine_ports)
            workers = _parallel(lambda h: self._finish_worker(h, n_extra), forked)
        except Exception:
            _parallel(self._stop_forked, forked)
            raise
        with self._lock:
            for h in forked:
                self._handles[h.id] = h
            self._roles[role] = _Role(
                role, "forked", [h.id for h in forked], target.spec, target_role, workers
            )
        return [h.id for h in forked]

    def _wait_forked(self, h: _Handle) -> None:
        deadline = time.monotonic() + FORK_HEALTH_TIMEOUT
        while True:
            self._check_alive(h)
            try:
                h.client.health(timeout=2.0)
                return
            except RPCConnectionError:
                if time.monotonic() > deadline:
                    raise WorkerTimeoutError(
                        f"forked worker {h.id} not healthy after {FORK_HEALTH_TIMEOUT:.0f}s"
                    ) from None
                time.sleep(0.5)

    def _stop_forked(self, h: _Handle) -> None:
        try:
            self._client_of(h.parent_id).kill_forked_worker(h.role, h.index)
        except (SchedulerError, KeyError) as e:
            logger.debug("kill_forked_worker %s via its parent failed: %s", h.id, e)
        if h.pid is not None and process_alive(h.pid):
            kill_process_tree(h.pid, grace=self.stop_grace)

    # --- engines ---

    def _handle(self, worker_id: str) -> _Handle:
        with self._lock:
            h = self._handles.get(worker_id)
        if h is None:
            raise WorkerNotFoundError(f"no worker {worker_id!r}")
        return h

    def _client_of(self, worker_id: str) -> RPCClient:
        h = self._handle(worker_id)
        if h.client is None and h.alias_of is not None:
            target = self._handle(h.alias_of)
            if target.client is None:
                raise WorkerNotFoundError(f"worker {h.alias_of!r} is not discovered yet")
            h.client = self._make_client(h, target.client.address)
        if h.client is None:
            raise WorkerNotFoundError(
                f"worker {worker_id!r} is not discovered yet; call get_workers({h.role!r}) first"
            )
        return h.client

    async def create_engine(
        self, worker_id: str, engine: str, engine_name: str | None = None, *args, **kwargs
    ) -> Any:
        h = self._handle(worker_id)
        name = await self._client_of(worker_id).async_create_engine(
            engine, engine_name or worker_id, *args, **kwargs
        )
        h.engines.append(name)
        return name

    async def set_worker_env(self, worker_id: str, env: dict[str, str]) -> None:
        await self._client_of(worker_id).async_set_env(env)

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
        result = self._client_of(worker_id).call_engine(
            method,
            *args,
            engine_name=engine_name or worker_id,
            rpc_meta=rpc_meta,
            http_timeout=http_timeout,
            max_retries=max_retries,
            retry_delay=retry_delay,
            **kwargs,
        )
        if method == "destroy":
            self._forget_engine(worker_id, engine_name or worker_id)
        return result

    def _forget_engine(self, worker_id: str, engine_name: str) -> None:
        """A destroyed engine is not destroyed again at teardown."""
        h = self._handle(worker_id)
        with self._lock:
            if engine_name in h.engines:
                h.engines.remove(engine_name)

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
        return await self._client_of(worker_id).async_call_engine(
            method,
            *args,
            engine_name=engine_name or worker_id,
            rpc_meta=rpc_meta,
            http_timeout=http_timeout,
            max_retries=max_retries,
            retry_delay=retry_delay,
            **kwargs,
        )

    # --- teardown ---

    def delete_workers(self, role: str | None = None, reverse_order: bool = False) -> None:
        """Destroy engines over RPC, then stop processes; dependents of a role go first."""
        with self._lock:
            if role is None:
                order = list(self._roles.values())
                if reverse_order:
                    order.reverse()
            elif role in self._roles:
                order = [r for r in self._roles.values() if r.target == role]
                order.append(self._roles[role])
            else:
                logger.debug("delete_workers: no role %r", role)
                return
        order.sort(key=lambda r: r.kind == "process")  # forked and aliased roles first
        for r in order:
            self._delete_role(r)
        if role is None:
            _teardown.unregister(self)

    def _delete_role(self, r: _Role) -> None:
        handles = [self._handles[wid] for wid in r.worker_ids if wid in self._handles]
        self._destroy_engines(handles)
        if r.kind == "process":
            popens = [h.process.popen for h in handles]
            kill_process_trees([p.pid for p in popens], self.stop_grace, popens)
        elif r.kind == "forked":
            _parallel(self._stop_forked, handles)
        for h in handles:
            if h.client is not None:
                h.client.close()
        name_resolve.clear_subtree(names.workers(self.experiment_name, self.trial_name, r.name))
        with self._lock:
            for h in handles:
                self._handles.pop(h.id, None)
            self._roles.pop(r.name, None)
        logger.info("Stopped role %s (%d workers)", r.name, len(handles))

    def _destroy_engines(self, handles: list[_Handle]) -> None:
        calls = []
        for h in handles:
            try:
                self._check_alive(h)
                client = self._client_of(h.id)
            except SchedulerError:
                continue  # dead or never discovered: nothing to destroy over RPC
            calls.extend((client, name) for name in h.engines)
        if not calls:
            return

        def destroy(call: tuple[RPCClient, str]) -> None:
            client, name = call
            try:
                client.call_engine(
                    "destroy", engine_name=name, http_timeout=self.destroy_timeout, max_retries=1
                )
            except SchedulerError as e:
                logger.warning("destroy of engine %s failed: %s", name, e)

        with concurrent.futures.ThreadPoolExecutor(min(32, len(calls))) as pool:
            list(pool.map(destroy, calls))

    def _emergency_stop(self) -> None:
        """Kill every worker tree at once (controller exit or signal); no RPCs, no threads."""
        with self._lock:
            popens = [h.process.popen for h in self._handles.values() if h.process is not None]
            forked = [h.pid for h in self._handles.values() if h.pid is not None]
            self._handles.clear()
            self._roles.clear()
        if popens or forked:
            kill_process_trees([*forked, *(p.pid for p in popens)], EMERGENCY_GRACE, popens)


def _parallel(fn: Any, items: list[Any]) -> list[Any]:
    """``[fn(x) for x in items]`` on threads (worker RPCs are independent); first error wins."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(min(32, len(items))) as pool:
        return list(pool.map(fn, items))


def _module_of(cmd: str | None) -> str | None:
    """The module of a ``python -m <module> ...`` command (None for the default)."""
    if not cmd:
        return None
    parts = shlex.split(cmd)
    if "-m" in parts and parts.index("-m") + 1 < len(parts):
        return parts[parts.index("-m") + 1]
    raise WorkerConfigurationError(
        f"a forked worker runs 'python -m <module>'; cannot fork with cmd {cmd!r}"
    )


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


class _Teardown:
    """Process-wide exit hooks: ``atexit`` plus SIGINT/SIGTERM handlers that chain on."""

    def __init__(self) -> None:
        self._live: set[LocalScheduler] = set()
        self._lock = threading.Lock()
        self._previous: dict[int, Any] = {}
        self._atexit_registered = False

    def register(self, scheduler: LocalScheduler) -> None:
        with self._lock:
            self._live.add(scheduler)
            if not self._atexit_registered:
                atexit.register(self.stop_all)
                self._atexit_registered = True
            if not self._previous and threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGINT, signal.SIGTERM):
                    self._previous[sig] = signal.signal(sig, self._on_signal)

    def unregister(self, scheduler: LocalScheduler) -> None:
        with self._lock:
            self._live.discard(scheduler)
            in_main = threading.current_thread() is threading.main_thread()
            if not self._live and self._previous and in_main:
                for sig, handler in self._previous.items():
                    signal.signal(sig, handler)
                self._previous.clear()

    def stop_all(self) -> None:
        with self._lock:
            live = list(self._live)
            self._live.clear()
        for scheduler in live:
            scheduler._emergency_stop()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop_all()
        previous = self._previous.get(signum)
        with self._lock:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


_teardown = _Teardown()
