"""What every scheduler shares: workers are RPC servers found through name resolution.

A concrete scheduler (local subprocesses, Slurm jobs) only decides how a role's worker
processes start, whether they still run, and how they stop. Everything else lives here
and behaves the same on every backend:

* roles and worker ids (``<role>/<index>``), colocation as a fork or as an alias,
* discovery: each worker registers ``"<ip>:<port>"`` under
  :func:`areal.utils.names.worker`; the scheduler health-checks it, reserves its extra
  ports and sends ``/configure``. A record another user could have written (see
  :class:`~areal.utils.name_resolve.NfsNameRecordRepository`) is refused before any
  request goes to its address, and a worker counts as found only once its signed
  ``/health`` answer verifies (:mod:`areal.infra.rpc.auth`),
* forking new workers beside a target role's through the target's ``/fork``
  (:mod:`areal.infra.scheduler.forked_workers`),
* engine creation and calls (with the liveness check of the backend), each stated once
  as a coroutine on the RPC loop (:mod:`areal.infra.rpc.loop`),
* teardown: engines destroyed over RPC, dependents first, and an ``atexit`` and
  SIGINT/SIGTERM hook that stops whatever the controller started.

The experiment's RPC token (``$AREAL_RPC_TOKEN`` if the controller has one, otherwise a
fresh random one) is held as a :class:`~areal.utils.secrets.SecretStr`; how it reaches
the workers is the backend's business, but never through a command line, and it never
travels in a request: requests and answers are signed with it instead. The secrets of
the experiment config (the proxy admin key...) take the same road, each only to the roles
that use it (:meth:`RPCWorkerScheduler.worker_secrets`, ``Job.secrets``); requests name
them, never carry them (:mod:`areal.infra.rpc.secret_env`). A forked worker gets its
secrets from a mode-0600 file in the trial's private ``.secrets`` directory, which it
removes once read (teardown removes any left over).
"""

from __future__ import annotations

import abc
import asyncio
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

from areal.api.cli_args import SchedulingSpec
from areal.api.config.scheduling import RPC_SERVER_CMD
from areal.api.scheduler_api import Job, Scheduler, Worker
from areal.infra.rpc.client import RPCClient
from areal.infra.rpc.loop import run_sync
from areal.infra.rpc.secret_env import SecretScope
from areal.infra.rpc.serialization import SerializationError
from areal.infra.scheduler.exceptions import (
    RPCAuthenticationError,
    RPCConnectionError,
    SchedulerError,
    WorkerConfigurationError,
    WorkerCreationError,
    WorkerNotFoundError,
    WorkerTimeoutError,
)
from areal.infra.scheduler.forked_workers import (
    FORK_HEALTH_TIMEOUT,
    RPC_SERVER_MODULE,
    ForkedWorkers,
)
from areal.infra.scheduler.run_secrets import RunSecrets
from areal.infra.scheduler.teardown import teardown
from areal.infra.scheduler.worker_records import (
    WorkerHandle,
    WorkerRole,
    controller_python_path,
    module_of,
    parallel,
)
from areal.utils import logging, name_resolve, names
from areal.utils.config_utils import redact_sensitive_config
from areal.utils.paths import get_log_path
from areal.utils.secrets import SecretStr

__all__ = [
    "FORK_HEALTH_TIMEOUT",
    "RPC_SERVER_MODULE",
    "RPCWorkerScheduler",
    "WorkerHandle",
    "WorkerRole",
    "controller_python_path",
    "module_of",
    "parallel",
]

logger = logging.getLogger("scheduler")


class RPCWorkerScheduler(ForkedWorkers, Scheduler):
    """A :class:`Scheduler` minus the backend: subclasses start, check and stop processes.

    ``exp_config`` is the experiment config (``experiment_name``, ``trial_name``,
    ``cluster``, ``seed``). ``startup_timeout`` bounds :meth:`get_workers`,
    ``stop_grace`` the wait between SIGTERM and SIGKILL, ``destroy_timeout`` each
    engine's ``destroy`` RPC at teardown.
    """

    #: whether checking a worker's process may block (a ``squeue``): then RPC clients run
    #: the check off their event loop
    liveness_check_blocks = True
    #: how the backend is named in messages ("local scheduler", "Slurm scheduler")
    backend_name = "scheduler"
    #: what ``cluster.name_resolve.nfs_record_root`` must be for this backend
    record_root_hint = "any local directory works"
    #: seconds between discovery rounds in :meth:`get_workers`
    poll_interval = 0.1

    def __init__(
        self,
        exp_config: Any,
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
                f"cluster.name_resolve.type {self._name_resolve.type!r}: the "
                f"{self.backend_name} discovers workers through 'nfs' records "
                f"({self.record_root_hint})"
            )
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.destroy_timeout = destroy_timeout
        self.log_dir = get_log_path(self.fileroot, self.experiment_name, self.trial_name)
        # the token, the inference key and the config's secrets; each role gets its own
        self._secrets = RunSecrets(exp_config, self.log_dir / ".secrets")
        self._roles: dict[str, WorkerRole] = {}
        self._handles: dict[str, WorkerHandle] = {}
        self._lock = threading.RLock()

        name_resolve.reconfigure(self._name_resolve)
        trial_root = names.trial_root(self.experiment_name, self.trial_name)
        try:
            name_resolve.clear_subtree(trial_root)
            name_resolve.claim_subtree(trial_root)  # ours (0700) before any worker registers
        except name_resolve.UnsafeNameRecordError as e:
            raise WorkerConfigurationError(str(e)) from None
        teardown.register(self)

    # --- what a backend provides ---

    @abc.abstractmethod
    def _start_role(
        self, role: str, specs: list[SchedulingSpec], colocate_with: WorkerRole | None
    ) -> list[str]:
        """Start one process per spec (on ``colocate_with``'s devices or nodes if given),
        register the role with :meth:`_register_role`, and return the worker ids."""

    @abc.abstractmethod
    def _check_started(self, h: WorkerHandle) -> None:
        """Raise ``WorkerFailedError`` when the process behind ``h`` is gone."""

    @abc.abstractmethod
    def _stop_started(self, r: WorkerRole, handles: list[WorkerHandle]) -> None:
        """Stop the processes of a ``process`` role (engines are already destroyed)."""

    @abc.abstractmethod
    def _emergency_stop(self) -> None:
        """Stop everything at once (controller exit or signal): no RPCs, no threads."""

    def _check_forked(self, h: WorkerHandle) -> None:
        """A forked worker lives on its parent's node; by default, check the parent."""
        if h.parent_id is not None and h.parent_id in self._handles:
            self._check_alive(self._handles[h.parent_id])

    def _kill_forked(self, h: WorkerHandle) -> None:
        """Last resort after the parent's ``/kill_forked_worker`` (default: nothing)."""

    def _fork_interpreter(self, target: WorkerRole) -> str:
        """The Python that runs a forked worker next to ``target``'s workers."""
        return sys.executable

    def _pending_hint(self, r: WorkerRole) -> str:
        """Extra words for a discovery timeout (e.g. a job still queued)."""
        return ""

    def _after_teardown(self) -> None:
        """Runs once every role is deleted."""

    # --- public helpers ---

    @property
    def n_gpus_per_node(self) -> int:
        return self.config.cluster.n_gpus_per_node

    @property
    def inference_api_key(self) -> SecretStr:
        """The run's inference-server API key (``$AREAL_INFERENCE_API_KEY`` on workers)."""
        return self._secrets.inference_key

    @property
    def rpc_token(self) -> SecretStr:
        """The token workers expect (for controller-side servers that workers call back)."""
        return self._secrets.token

    def secret_scope(self, role: str) -> SecretScope:
        """Which secrets ``role``'s workers get (``Job.secrets`` of its job)."""
        return self._secrets.scope(role)

    def worker_secrets(self, role: str) -> dict[str, str]:
        """The variables ``role``'s workers get through a private channel (the backend's
        business: their environment, or a mode-0600 file), never a command line."""
        return self._secrets.for_role(role)

    def _write_secrets(self, name: str, values: dict[str, str]) -> Path:
        return self._secrets.write_file(name, values)

    def _remove_secrets(self) -> None:
        self._secrets.remove_files()

    def __enter__(self) -> RPCWorkerScheduler:
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
        self._secrets.set_scope(role, job.secrets)
        strategy = job.scheduling_strategy
        if strategy is not None and strategy.type == "colocation":
            target = self._role(strategy.target)
            n_target = len(target.worker_ids)
            if strategy.fork and job.replicas < n_target and n_target % job.replicas == 0:
                # a TP server on several workers' devices: beside the first of each group
                group = n_target // job.replicas
                return self.fork_workers(role, target.name, module_of(specs[0].cmd), group)
            if job.replicas == n_target:
                if strategy.fork:
                    return self.fork_workers(role, target.name, module_of(specs[0].cmd))
                if job.secrets != target.secrets:
                    raise WorkerCreationError(
                        f"role {role!r} would share the worker processes of {target.name!r}, "
                        f"which do not hold the {job.secrets!r} secrets it uses; colocate it "
                        "with fork: true (its own processes beside them)"
                    )
                return self._alias(role, target)
            # a different replica count: new processes on the target's devices or nodes
            if strategy.fork:
                logger.warning(
                    "role %r: %d replica(s) do not split %d %s worker(s) into equal groups, so "
                    "fork is not possible; starting new processes on their devices instead",
                    role,
                    job.replicas,
                    n_target,
                    target.name,
                )
            return self._start_role(role, specs, colocate_with=target)
        return self._start_role(role, specs, colocate_with=None)

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

    def _role(self, name: str | None) -> WorkerRole:
        with self._lock:
            role = self._roles.get(name or "")
        if role is None:
            raise WorkerNotFoundError(f"no role {name!r} (known: {sorted(self._roles)})")
        return role

    def _register_role(self, r: WorkerRole, handles: list[WorkerHandle]) -> None:
        r.secrets = self.secret_scope(r.name)
        with self._lock:
            for h in handles:
                self._handles[h.id] = h
            self._roles[r.name] = r

    @classmethod
    def _uniform_spec(
        cls, role: str, specs: list[SchedulingSpec], why: str
    ) -> tuple[SchedulingSpec, list[str]]:
        """The one spec of a role whose replicas must all be alike (``why``: the backend's
        reason), and its checked worker command."""
        spec = specs[0]
        if any(s != spec for s in specs[1:]):
            raise WorkerConfigurationError(
                f"role {role!r}: {why}, so the replicas' scheduling specs must be equal"
            )
        cmd = shlex.split(spec.cmd or RPC_SERVER_CMD)
        cls._check_worker_cmd(cmd, role)
        return spec, cmd

    @staticmethod
    def _check_worker_cmd(cmd: list[str], role: str) -> None:
        if not cmd:
            raise WorkerConfigurationError(f"role {role!r}: scheduling spec cmd is empty")
        if any(a == "--port" or a.startswith("--port=") for a in cmd):
            raise WorkerConfigurationError(
                f"role {role!r}: remove --port from the scheduling spec cmd; the scheduler "
                "lets each worker pick a free port and discovers it"
            )

    def _identity_flags(self, role: str, index: int | None) -> list[str]:
        """The RPC server's naming flags (``index`` None: the worker reads $SLURM_PROCID)."""
        flags = ["--experiment-name", self.experiment_name, "--trial-name", self.trial_name]
        flags += ["--role", role]
        if index is not None:
            flags += ["--worker-index", str(index)]
        return [
            *flags,
            "--name-resolve-type",
            self._name_resolve.type,
            "--nfs-record-root",
            self._name_resolve.nfs_record_root,
            "--fileroot",
            self.fileroot,
        ]

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
                        f"workers {pending} were not up after {timeout:.0f}s"
                        f"{self._pending_hint(r)}; see {self.log_dir / (role + '.log')}"
                    )
                time.sleep(self.poll_interval)
        handles = [self._handles[wid] for wid in r.worker_ids]
        r.ready = run_sync(self._finish_workers(handles, r.spec.port_count - 1))
        return list(r.ready)

    def _discover(self, h: WorkerHandle) -> bool:
        """Whether ``h`` has registered and answers ``/health`` (raises if it died)."""
        self._check_alive(h)
        key = names.worker(self.experiment_name, self.trial_name, h.role, h.index)
        try:
            address = name_resolve.get(key)
        except name_resolve.NameEntryNotFoundError:
            return False
        except name_resolve.UnsafeNameRecordError as e:
            # never contacted: a planted record must not even receive a signed request
            raise WorkerConfigurationError(f"worker {h.id}: {e}") from None
        client = self._make_client(h, address)
        try:
            run_sync(client.health(timeout=2.0))  # signed both ways: only a real worker passes
        except RPCConnectionError:
            run_sync(client.close())
            return False
        except RPCAuthenticationError:
            run_sync(client.close())
            raise
        h.client = client
        return True

    def _make_client(self, h: WorkerHandle, address: str) -> RPCClient:
        given, withheld = self._secrets.for_requests(h.role)
        return RPCClient(
            address,
            token=self.rpc_token,
            worker_id=h.id,
            liveness_check=lambda: self._check_alive(h),
            liveness_check_blocks=self.liveness_check_blocks,
            secret_env=given,
            withheld_secrets=withheld,
        )

    async def _finish_workers(self, handles: list[WorkerHandle], extra_ports: int) -> list[Worker]:
        """Every worker's extra ports reserved and its ``/configure`` sent, at once."""
        return list(await asyncio.gather(*(self._finish(h, extra_ports) for h in handles)))

    async def _finish(self, h: WorkerHandle, extra_ports: int) -> Worker:
        """Reserve the extra ports and configure the worker; its ``Worker`` record."""
        assert h.client is not None
        ip, port = h.client.address.rsplit(":", 1)
        extra = []
        if extra_ports > 0:
            extra = [str(p) for p in await h.client.alloc_ports(extra_ports)]
        try:
            await h.client.configure(self.config, h.role, h.index)
        except SerializationError:
            # a config class outside the allowlisted packages: send its fields as a dict
            await h.client.configure(redact_sensitive_config(self.config), h.role, h.index)
        h.worker = Worker(h.id, ip, [port, *extra], extra)
        return h.worker

    def _check_alive(self, h: WorkerHandle) -> None:
        if h.alias_of is not None:
            self._check_alive(self._handles[h.alias_of])
        elif h.parent_id is not None:
            self._check_forked(h)
        else:
            self._check_started(h)

    def _alias(self, role: str, target: WorkerRole) -> list[str]:
        ids = [f"{role}/{i}" for i in range(len(target.worker_ids))]
        handles = [
            WorkerHandle(wid, role, i, alias_of=target_id)
            for i, (wid, target_id) in enumerate(zip(ids, target.worker_ids))
        ]
        self._register_role(
            WorkerRole(role, "alias", ids, target.spec, target=target.name), handles
        )
        return ids

    # --- engines ---

    def _handle(self, worker_id: str) -> WorkerHandle:
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
        name = await self._client_of(worker_id).create_engine(
            engine, engine_name or worker_id, *args, **kwargs
        )
        h.engines.append(name)
        return name

    async def set_worker_env(self, worker_id: str, env: dict[str, str]) -> None:
        await self._client_of(worker_id).set_env(env)

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
        result = await self._client_of(worker_id).call_engine(
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
            teardown.unregister(self)
            self._remove_secrets()
            self._after_teardown()

    def _delete_role(self, r: WorkerRole) -> None:
        handles = [self._handles[wid] for wid in r.worker_ids if wid in self._handles]
        self._destroy_engines(handles)
        if r.kind == "process":
            self._stop_started(r, handles)
        elif r.kind == "forked":
            parallel(self._stop_forked, handles)
        clients = [h.client for h in handles if h.client is not None]
        run_sync(_all(client.close() for client in clients))
        name_resolve.clear_subtree(names.workers(self.experiment_name, self.trial_name, r.name))
        with self._lock:
            for h in handles:
                self._handles.pop(h.id, None)
            self._roles.pop(r.name, None)
        logger.info("Stopped role %s (%d workers)", r.name, len(handles))

    def _destroy_engines(self, handles: list[WorkerHandle]) -> None:
        calls = []
        for h in handles:
            try:
                self._check_alive(h)
                client = self._client_of(h.id)
            except SchedulerError:
                continue  # dead or never discovered: nothing to destroy over RPC
            calls.extend(self._destroy(client, name) for name in h.engines)
        run_sync(_all(calls))

    async def _destroy(self, client: RPCClient, engine_name: str) -> None:
        try:
            await client.call_engine(
                "destroy", engine_name=engine_name, http_timeout=self.destroy_timeout, max_retries=1
            )
        except SchedulerError as e:
            logger.warning("destroy of engine %s failed: %s", engine_name, e)


async def _all(calls: Any) -> list[Any]:
    return list(await asyncio.gather(*calls))
