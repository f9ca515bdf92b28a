"""``RayScheduler``: the same RPC workers, started as actors of a running Ray cluster.

Each worker is a Ray actor (:class:`~areal.infra.scheduler.ray_actors.WorkerHost`) that
holds the resources of its ``scheduling_spec`` (CPUs, GPUs, memory) and starts the RPC
server process on its node, the one local and Slurm workers run. A role's actors sit in
placement groups laid out as on Slurm (:mod:`areal.infra.scheduler.ray_placement`);
forked roles (colocated servers) start through their target worker's ``/fork`` as on
every backend, so they share its node and devices. Workers register ``ip:port`` in the
name-resolve records and are then used exactly as elsewhere
(:mod:`areal.infra.scheduler.rpc_workers`): the records and the trial's log directory must
be on storage every Ray node shares, as under Slurm.

The scheduler connects to a running cluster, ``scheduler.ray_address`` or else
``$RAY_ADDRESS``, and refuses to run without one: ``ray.init()`` with no address would
start a private cluster inside the controller. Actors live in the namespace
``areal_<experiment>_<trial>`` and are named by worker id (``actor/0``), so a trial's
actors are found with ``ray list actors --filter ray_namespace=...``; a second controller
of a trial whose actors still run is refused.

Secrets never pass through Ray: not as actor arguments, not in a runtime environment
(Ray records both in its job and actor metadata). Each worker gets the path of a mode-0600
file in the trial's private secrets directory, which its RPC server reads into its
environment and removes at start.

A worker counts as dead when its actor dies (Ray's actor state) or its server process
exits (the actor's answer); the liveness check that runs before every RPC then raises
``WorkerFailedError`` naming the worker. Stopping a role stops each server, kills its
actors and removes its placement groups. The actors are owned by the controller's Ray
job, so Ray also ends them when the controller dies without cleanup.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from areal.api.cli_args import SchedulingSpec
from areal.infra.rpc.processes import read_log_tail
from areal.infra.scheduler.exceptions import (
    SchedulerError,
    WorkerConfigurationError,
    WorkerCreationError,
    WorkerFailedError,
)
from areal.infra.scheduler.ray_actors import WorkerHost, WorkerLaunch
from areal.infra.scheduler.ray_placement import (
    RayPlacement,
    plan_placement,
    ray_address,
    ray_namespace,
)
from areal.infra.scheduler.rpc_workers import (
    RPCWorkerScheduler,
    WorkerHandle,
    WorkerRole,
    controller_python_path,
)
from areal.utils import logging
from areal.utils.secrets import SecretStr

__all__ = ["RayScheduler"]

logger = logging.getLogger("scheduler.ray")

STATUS_WAIT = 2.0  # seconds a liveness check waits for a host actor's answer
STOP_WAIT = 10.0  # seconds beyond the stop grace that stopping waits for the hosts
INFO_TIMEOUT = 60.0  # seconds to wait for a placed host actor to describe itself
GCS_CONNECT_TIMEOUT = 5.0  # ray.init retries an unreachable address for minutes
HOST_CONCURRENCY = 4  # a host answers polls while it stops its server


@dataclass(frozen=True)
class _Status:
    """What a host actor last said: ``starting`` (not placed or not answering yet),
    ``running``, ``exited`` (its server; ``exit_code``) or ``dead`` (the actor)."""

    state: Literal["starting", "running", "exited", "dead"]
    exit_code: int | None = None
    detail: str = ""


@dataclass
class _HostActor:
    """A worker's host actor, what it said about itself, and its last liveness answer."""

    actor: Any
    name: str
    role: str
    info: dict[str, Any] | None = None
    status: _Status = field(default_factory=lambda: _Status("starting"))
    checked_at: float = 0.0
    pending_poll: Any = None  # an unanswered poll() reference
    lock: threading.Lock = field(default_factory=threading.Lock)


class RayScheduler(RPCWorkerScheduler):
    """Workers as Ray actors; see the module docstring.

    ``address`` overrides ``scheduler.ray_address`` and ``$RAY_ADDRESS``; ``status_ttl``
    is how long a host actor's answer is reused by liveness checks.
    """

    backend_name = "Ray scheduler"
    record_root_hint = "a directory every Ray node shares"
    poll_interval = 0.5

    def __init__(
        self,
        exp_config: Any,
        *,
        address: str | None = None,
        startup_timeout: float = 300.0,
        stop_grace: float = 10.0,
        destroy_timeout: float = 30.0,
        status_ttl: float = 1.0,
    ):
        configured = address or getattr(getattr(exp_config, "scheduler", None), "ray_address", None)
        self.address, where = ray_address(configured, os.environ)
        ray = _import_ray()
        self.namespace = ray_namespace(exp_config.experiment_name, exp_config.trial_name)
        self.status_ttl = status_ttl
        self._workers: dict[str, _HostActor] = {}
        self._groups: dict[str, list[Any]] = {}
        self._connected_here = self._connect(ray, where)
        self._host_class = ray.remote(WorkerHost)
        try:
            super().__init__(
                exp_config,
                startup_timeout=startup_timeout,
                stop_grace=stop_grace,
                destroy_timeout=destroy_timeout,
            )
        except BaseException:
            self._disconnect()
            raise

    # --- connecting ---

    def _connect(self, ray: Any, where: str) -> bool:
        """Join the cluster (True) or reuse this process's connection (False)."""
        if ray.is_initialized():
            logger.info("Using this process's Ray connection; actors go to %s", self.namespace)
            return False
        _check_reachable(self.address, where)
        try:
            ray.init(address=self.address, namespace=self.namespace, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise SchedulerError(
                f"cannot connect to the Ray cluster at {self.address!r} ({where}): {e}"
            ) from None
        logger.info("Connected to the Ray cluster at %s (%s)", self.address, where)
        return True

    def _disconnect(self) -> None:
        import ray

        if self._connected_here and ray.is_initialized():
            ray.shutdown()
        self._connected_here = False

    # --- starting actors ---

    def _start_role(
        self, role: str, specs: list[SchedulingSpec], colocate_with: WorkerRole | None
    ) -> list[str]:
        from ray.util.placement_group import placement_group

        spec, cmd = self._uniform_spec(
            role, specs, "a role's workers share one placement layout on Ray"
        )
        self._refuse_taken_names(role, len(specs))
        if spec.additional_bash_cmds:
            logger.warning(
                "role %s: scheduling_spec.additional_bash_cmds are not run on Ray (there is no "
                "container step); the worker gets its secrets from the controller",
                role,
            )
        plain, secret = _split_env_vars(spec, role)
        values = {**self.worker_secrets(role), **secret}
        if colocate_with is None:
            plan = plan_placement(spec, len(specs), self.n_gpus_per_node, role)
            groups = [
                placement_group(
                    [dict(plan.bundle) for _ in block.workers],
                    strategy=block.strategy,
                    name=f"{self.namespace}:{role}:{number}",
                )
                for number, block in enumerate(plan.blocks)
            ]
            options = [self._bundle_options(plan, groups, i) for i in range(len(specs))]
            devices: list[str | None] = [None] * len(specs)
        else:
            groups = []
            beside = self._beside(colocate_with, len(specs))
            options = [_node_options(node_id) for node_id, _ in beside]
            devices = [visible for _, visible in beside]
        hosts: list[_HostActor] = []
        try:
            for index, (opts, visible) in enumerate(zip(options, devices)):
                worker_id = f"{role}/{index}"
                launch = WorkerLaunch(
                    worker_id=worker_id,
                    role=role,
                    cmd=(*cmd, *self._identity_flags(role, index)),
                    python_path=controller_python_path(),
                    log_dir=str(self.log_dir),
                    secrets_file=str(self._write_secrets(f"{role}.{index}", values)),
                    env_vars=plain,
                    cwd=os.getcwd(),
                    visible_devices=visible,
                )
                actor = self._host_class.options(
                    name=worker_id,
                    namespace=self.namespace,
                    max_concurrency=HOST_CONCURRENCY,
                    max_restarts=0,
                    **opts,
                ).remote(launch)
                hosts.append(_HostActor(actor, worker_id, role))
        except Exception:
            self._kill(hosts, groups)
            raise
        logger.info(
            "Started %s as Ray actors %s in namespace %s (%s each)",
            role,
            ", ".join(h.name for h in hosts),
            self.namespace,
            _describe(options[0]),
        )
        handles = [WorkerHandle(f"{role}/{i}", role, i) for i in range(len(specs))]
        with self._lock:
            self._workers.update((h.id, host) for h, host in zip(handles, hosts))
            self._groups[role] = groups
        self._register_role(WorkerRole(role, "process", [h.id for h in handles], spec), handles)
        return [h.id for h in handles]

    @staticmethod
    def _bundle_options(plan: RayPlacement, groups: list[Any], index: int) -> dict[str, Any]:
        """Actor options of worker ``index``: its bundle's resources, in its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        number, bundle_index = plan.block_of(index)
        options: dict[str, Any] = {
            "num_cpus": plan.bundle["CPU"],
            "num_gpus": plan.bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                groups[number], placement_group_bundle_index=bundle_index
            ),
        }
        if "memory" in plan.bundle:
            options["memory"] = int(plan.bundle["memory"])
        return options

    def _beside(self, target: WorkerRole, replicas: int) -> list[tuple[str, str]]:
        """``(Ray node id, devices)`` for each of ``replicas`` new workers placed on
        ``target``'s: worker ``i`` joins the ``i``-th of ``replicas`` equal slices of the
        target's workers and sees the devices of that slice's workers on its node."""
        self.get_workers(target.name)  # placed and running
        infos = [self._info(self._host_of(wid)) for wid in target.worker_ids]
        beside = []
        for i in range(replicas):
            first = i * len(infos) // replicas
            last = max(first + 1, (i + 1) * len(infos) // replicas)
            node = infos[first]["node_id"]
            seen: list[str] = []
            for info in infos[first:last]:
                if info["node_id"] != node:
                    continue
                for device in str(info["visible_devices"] or "").split(","):
                    if device and device not in seen:
                        seen.append(device)
            beside.append((node, ",".join(seen)))
        return beside

    def _refuse_taken_names(self, role: str, replicas: int) -> None:
        """Refuse to start beside live actors of this trial (another controller's)."""
        import ray

        for index in range(replicas):
            name = f"{role}/{index}"
            try:
                ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                continue
            raise WorkerCreationError(
                f"Ray actor {name!r} already runs in namespace {self.namespace!r}: another "
                f"controller of trial {self.experiment_name}/{self.trial_name} uses this "
                "cluster; stop it (ray job stop, or ray kill its actors) or use another "
                "trial_name"
            )

    def _host_of(self, worker_id: str) -> _HostActor:
        """The host actor whose process runs ``worker_id`` (an alias's or fork's target)."""
        h = self._handle(worker_id)
        while h.alias_of is not None or h.parent_id is not None:
            h = self._handle(h.alias_of or h.parent_id)
        return self._workers[h.id]

    def _info(self, host: _HostActor) -> dict[str, Any]:
        import ray

        if host.info is None:
            host.info = ray.get(host.actor.info.remote(), timeout=INFO_TIMEOUT)
        return host.info

    def _fork_interpreter(self, target: WorkerRole) -> str:
        # a forked worker runs on the target's node, with the Python Ray runs there
        return self._info(self._host_of(target.worker_ids[0]))["python"]

    def _pending_hint(self, r: WorkerRole) -> str:
        from ray.util.placement_group import placement_group_table

        with self._lock:
            groups = list(self._groups.get(r.name, []))
        states = []
        for pg in groups:
            with contextlib.suppress(Exception):
                states.append(str(placement_group_table(pg).get("state", "UNKNOWN")))
        if states and any(state != "CREATED" for state in states):
            import ray

            return (
                f"; its placement group(s) are {', '.join(states)}: the cluster has not "
                f"granted the bundles (free now: {ray.available_resources()}); lower the "
                "role's scheduling_spec (cpu, gpu, mem) or add nodes"
            )
        return (
            "; its Ray actors are placed (workers on other nodes must see "
            f"cluster.name_resolve.nfs_record_root {self._name_resolve.nfs_record_root})"
        )

    # --- liveness ---

    def _status(self, host: _HostActor) -> _Status:
        """The host's last answer, asked again after ``status_ttl`` seconds."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError, RayError

        with host.lock:
            now = time.monotonic()
            final = host.status.state in ("exited", "dead")
            if final or now - host.checked_at < self.status_ttl:
                return host.status
            status = host.status  # not placed yet, busy or unreachable: as before
            try:
                if host.pending_poll is None:
                    host.pending_poll = host.actor.poll.remote()
                ready, _ = ray.wait([host.pending_poll], timeout=STATUS_WAIT)
            except Exception as e:  # the controller's own connection to the cluster
                logger.warning("asking Ray actor %s for its state failed: %s", host.name, e)
                ready = []
            if ready:
                reference, host.pending_poll = host.pending_poll, None
                try:
                    code = ray.get(reference)
                except ActorUnavailableError:
                    pass  # unreachable for now (e.g. restarting its connection)
                except RayActorError as e:
                    status = _Status("dead", detail=_death_cause(e))
                except RayError as e:  # the cluster itself: do not declare the worker dead
                    logger.warning("asking Ray actor %s for its state failed: %s", host.name, e)
                else:
                    status = _Status("running" if code is None else "exited", code)
            host.status, host.checked_at = status, now
            return status

    def _check_started(self, h: WorkerHandle) -> None:
        with self._lock:
            host = self._workers.get(h.id)
        if host is None:
            raise WorkerFailedError(h.id, None, "its Ray actor was stopped")
        status = self._status(host)
        where = f"Ray actor {host.name!r} in namespace {self.namespace!r}"
        if status.state == "exited":
            raise WorkerFailedError(
                h.id, status.exit_code, f"its server in {where} exited\n{self._tail(host)}"
            )
        if status.state == "dead":
            log = read_log_tail(self.log_dir / f"{h.role}.log")
            raise WorkerFailedError(h.id, None, f"{where} died: {status.detail}\n{log}")

    def _tail(self, host: _HostActor) -> str:
        import ray

        with contextlib.suppress(Exception):
            return ray.get(host.actor.tail.remote(), timeout=10.0)
        return read_log_tail(self.log_dir / f"{host.role}.log")

    # --- stopping ---

    def _stop_started(self, r: WorkerRole, handles: list[WorkerHandle]) -> None:
        import ray

        with self._lock:
            hosts = [self._workers.pop(h.id) for h in handles if h.id in self._workers]
            groups = self._groups.pop(r.name, [])
        # each running server's tree in order first (engines are destroyed already), then
        # the actors; a host that never answered (not placed) has nothing to stop
        running = [host for host in hosts if host.status.state == "running"]
        stops = [host.actor.stop.remote(self.stop_grace) for host in running]
        if stops:
            with contextlib.suppress(Exception):
                ray.wait(stops, num_returns=len(stops), timeout=self.stop_grace + STOP_WAIT)
        self._kill(hosts, groups)

    def _kill(self, hosts: list[_HostActor], groups: list[Any]) -> None:
        """Kill the actors (a server then ends with its host) and remove the groups."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for host in hosts:
            with contextlib.suppress(Exception):
                ray.kill(host.actor, no_restart=True)
        for pg in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)

    def _emergency_stop(self) -> None:
        """Kill every actor and remove every group at once (controller exit or signal)."""
        with self._lock:
            hosts = list(self._workers.values())
            groups = [pg for role_groups in self._groups.values() for pg in role_groups]
            self._workers.clear()
            self._groups.clear()
            self._handles.clear()
            self._roles.clear()
        if hosts or groups:
            self._kill(hosts, groups)
        self._remove_secrets()

    def _after_teardown(self) -> None:
        self._disconnect()


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise SchedulerError(
            "scheduler.type 'ray' needs the ray package on the controller and on every node "
            "of the cluster: pip install 'areal-arena[ray]'"
        ) from None
    return ray


def _check_reachable(address: str, where: str) -> None:
    """Fail at once when a ``host:port`` address does not answer (``ray.init`` would retry
    it for minutes); ``auto`` and ``ray://`` addresses are left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise SchedulerError(
            f"{where} {address!r} is not a Ray address: give host:port (the GCS of the "
            "cluster's head, e.g. 10.0.0.1:6379), 'auto' or ray://host:10001"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), GCS_CONNECT_TIMEOUT):
            pass
    except OSError as e:
        raise SchedulerError(
            f"no Ray cluster answers at {address} ({where}): {e}; start the cluster first "
            "(ray start --head) or fix the address"
        ) from None


def _split_env_vars(spec: SchedulingSpec, role: str) -> tuple[dict[str, str], dict[str, str]]:
    """``(plain, secret)`` values of the spec's ``env_vars``: secrets go to the worker's
    secrets file, never to Ray."""
    plain: dict[str, str] = {}
    secret: dict[str, str] = {}
    for key, value in (spec.env_vars or {}).items():
        if not str(key).isidentifier():
            raise WorkerConfigurationError(
                f"role {role!r}: env_vars: {key!r} is not a valid variable name"
            )
        if isinstance(value, SecretStr):
            secret[str(key)] = value.reveal()
        else:
            plain[str(key)] = str(value)
    return plain, secret


def _node_options(node_id: str) -> dict[str, Any]:
    """A worker on another role's node and devices: no resources of its own."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return {"num_cpus": 0, "num_gpus": 0, "scheduling_strategy": strategy}


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _death_cause(error: Exception) -> str:
    """Ray's reason for an actor's death: its first line and, after a traceback, the last
    (the exception that ended a failed start)."""
    lines = [_ANSI.sub("", line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return type(error).__name__
    cause = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return cause[:800]


def _describe(options: dict[str, Any]) -> str:
    text = f"{options.get('num_cpus', 0):g} CPU(s)"
    if options.get("num_gpus"):
        text += f", {options['num_gpus']:g} GPU(s)"
    if options.get("memory"):
        text += f", {options['memory'] / 1024**3:g} GiB memory"
    if "scheduling_strategy" in options and not options.get("num_cpus"):
        text += " on another role's node"
    return text
