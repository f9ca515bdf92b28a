"""``SlurmScheduler``: one sbatch job per role, workers in containers.

Each role becomes ``{fileroot}/logs/{user}/{exp}/{trial}/{role}.sh``, submitted with
``sbatch``; its single ``srun`` step starts every replica inside the container binary
``$AREAL_CONTAINER_BIN`` (default ``apptainer``; ``container_type: none`` runs on the
host). Workers register through name resolution and are then used exactly like local
ones (:mod:`areal.infra.scheduler.rpc_workers`). The script itself, its quoting and
the resource math live in :mod:`areal.infra.scheduler.slurm_batch`.

Unlike the reference, the spec's ``container_type``, ``mount`` and
``srun_additional_args`` are honoured, environment values are quoted (``$NAME`` expands
on the worker on purpose, nothing else does), and a job that Slurm accepted but can
never start (``PartitionConfig``, ``BadConstraints``, or a request larger than every
node of the partition) is cancelled with a message naming the job and the reason,
instead of being waited on until the startup timeout.

The RPC token and the config's secrets reach the workers only through their
environment. The scheduler writes them to a mode-0600 file under the trial's log
directory; the batch script sources that file and deletes it at job start. They are
therefore never in a job script (``scontrol write batch_script``), in ``scontrol show
job``, in any argv, nor in the environment ``sbatch`` stores with the job (the submit
environment is stripped of them).

A killed controller runs no cleanup. When it runs in a Slurm job itself, each worker job
records that job and cancels itself once it is over (see
:func:`~areal.infra.scheduler.slurm_batch.controller_watcher`); and before its first
submission a scheduler cancels the worker jobs a dead controller of the same trial left
in the queue, or refuses to start beside those of a live one
(:mod:`areal.infra.scheduler.slurm_leftovers`).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal.api.cli_args import SchedulingSpec
from areal.api.config.scheduling import RPC_SERVER_CMD
from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.inference.auth import API_KEY_ENV
from areal.infra.rpc.processes import read_log_tail
from areal.infra.rpc.secret_env import SECRET_ENV_PREFIX
from areal.infra.scheduler.exceptions import (
    SchedulerError,
    WorkerCreationError,
    WorkerFailedError,
)
from areal.infra.scheduler.rpc_workers import (
    RPCWorkerScheduler,
    WorkerHandle,
    WorkerRole,
    controller_python_path,
)
from areal.infra.scheduler.slurm_batch import (
    BatchJob,
    SlurmResources,
    batch_script,
    plan_resources,
    split_env,
    worker_env,
)
from areal.infra.scheduler.slurm_leftovers import ended_controllers, find_leftovers
from areal.utils import logging
from areal.utils.lifeline import PARENT_PID_ENV
from areal.utils.logging import SECRET_ENV_VARS
from areal.utils.paths import get_user

__all__ = ["CONTAINER_BIN_ENV", "JobStatus", "SlurmScheduler", "capacity_problem"]

logger = logging.getLogger("scheduler.slurm")

CONTAINER_BIN_ENV = "AREAL_CONTAINER_BIN"
SLURM_CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo")
KILL_WAIT = 10.0  # seconds to wait for a job after SIGKILL

# States in which the job's workers run or may still come up.
ALIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "RESIZING", "UNKNOWN"}
)
# States squeue lists by default: the job is not over yet.
ACTIVE_STATES = ALIVE_STATES | {"COMPLETING", "SIGNALING", "STAGE_OUT", "STOPPED"}

# Pending reasons that no amount of waiting resolves (the cluster's configuration would
# have to change); the job is cancelled at once.
NEVER_STARTS = {
    "PartitionConfig": "the request exceeds what the partition's nodes or limits allow "
    "(CPUs, memory, GPUs or node count)",
    "BadConstraints": "no node can satisfy the job's constraints",
    "PartitionTimeLimit": "its time limit exceeds the partition's MaxTime",
    "DependencyNeverSatisfied": "a job it depends on can never complete",
    "InvalidAccount": "the account is invalid",
    "InvalidQOS": "the QOS is invalid",
}
# Pending reasons that are usually transient; the request is compared with the capacity
# of the partition's nodes once, and cancelled if no set of nodes could ever hold it.
CAPACITY_REASONS = frozenset({"Resources", "ReqNodeNotAvail", "PartitionNodeLimit", "NodeDown"})


@dataclass
class JobStatus:
    """``squeue``'s view of a job (``state`` is ``GONE`` once Slurm forgot it)."""

    state: str
    reason: str = ""
    nodes: str = ""
    partition: str = ""


@dataclass
class _JobRef:
    """A Slurm job and its last ``squeue`` status (reused for ``status_ttl`` seconds)."""

    job_id: str
    name: str
    status: JobStatus | None = field(default=None, kw_only=True)
    checked_at: float = field(default=0.0, kw_only=True)


@dataclass
class _SlurmJob(_JobRef):
    """A role's job, submitted by this scheduler."""

    role: str
    resources: SlurmResources
    secrets_file: Path
    capacity_checked: bool = False


class SlurmScheduler(RPCWorkerScheduler):
    """Workers as Slurm jobs; see the module docstring.

    ``container_bin`` overrides ``$AREAL_CONTAINER_BIN`` (a command, split by shell
    rules); ``status_ttl`` is how long a job's ``squeue`` state is reused by liveness
    checks. ``controller_job`` is the controller's own Slurm job (``$SLURM_JOB_ID``), if
    any; worker jobs end with it, checking every ``controller_poll`` seconds.
    """

    backend_name = "Slurm scheduler"
    record_root_hint = "a directory every node shares"
    poll_interval = 0.5
    controller_poll = 10.0  # seconds between a worker job's checks of the controller's job

    def __init__(
        self,
        exp_config: Any,
        *,
        container_bin: str | None = None,
        startup_timeout: float = 300.0,
        stop_grace: float = 10.0,
        destroy_timeout: float = 30.0,
        status_ttl: float = 1.0,
    ):
        missing = [name for name in SLURM_CLIENTS if shutil.which(name) is None]
        if missing:
            raise SchedulerError(
                f"scheduler.type 'slurm' needs the Slurm client commands on PATH; missing: "
                f"{', '.join(missing)}"
            )
        super().__init__(
            exp_config,
            startup_timeout=startup_timeout,
            stop_grace=stop_grace,
            destroy_timeout=destroy_timeout,
        )
        binary = container_bin or os.environ.get(CONTAINER_BIN_ENV) or "apptainer"
        self.container_bin = shlex.split(binary)
        self.enable_offload = bool(getattr(exp_config, "enable_offload", False))
        self.status_ttl = status_ttl
        controller_job = os.environ.get("SLURM_JOB_ID", "")
        self.controller_job = controller_job if controller_job.isdigit() else None
        self._jobs: dict[str, _SlurmJob] = {}
        self._status_lock = threading.Lock()
        self._leftovers_cleared = False
        for what, path in (
            ("cluster.fileroot", self.fileroot),
            ("cluster.name_resolve.nfs_record_root", self._name_resolve.nfs_record_root),
        ):
            _warn_if_local_storage(what, path)

    def job_ids(self) -> dict[str, str]:
        """The Slurm job id of every role this scheduler submitted and still tracks."""
        with self._lock:
            return {role: record.job_id for role, record in self._jobs.items()}

    # --- submitting ---

    def _start_role(
        self, role: str, specs: list[SchedulingSpec], colocate_with: WorkerRole | None
    ) -> list[str]:
        spec, _ = self._uniform_spec(role, specs, "one srun step starts every replica on Slurm")
        self._clear_leftovers()
        pinned = self._nodes_of(colocate_with) if colocate_with is not None else None
        resources = plan_resources(spec, len(specs), self.n_gpus_per_node, role, pinned)
        env = worker_env(
            spec,
            cpus_per_task=resources.cpus_per_task,
            python_path=controller_python_path(),
            enable_offload=self.enable_offload,
            user=get_user(),
        )
        secrets = {**self.worker_secrets(role), **split_env(env, spec.container_type)[2]}
        secrets_file = self._write_secrets(role, secrets)
        job = BatchJob(
            role=role,
            job_name=self._job_prefix + role,
            resources=resources,
            spec=spec,
            env=env,
            worker_flags=self._identity_flags(role, None),
            container_bin=self.container_bin,
            log_dir=self.log_dir,
            secrets_file=secrets_file,
            controller_job=self.controller_job,
            controller_poll=self.controller_poll,
        )
        script = self.log_dir / f"{role}.sh"
        try:
            script.write_text(batch_script(job))
            job_id = self._submit(role, script, resources)
        except BaseException:
            secrets_file.unlink(missing_ok=True)
            raise
        record = _SlurmJob(
            job_id, job.job_name, role=role, resources=resources, secrets_file=secrets_file
        )
        with self._lock:
            self._jobs[role] = record
        logger.info("Submitted %s as Slurm job %s (%s)", role, job_id, _describe(resources))
        try:  # Slurm often knows at once that the request can never be met
            self._raise_if_stuck(record, self._status(record, fresh=True))
        except SchedulerError:
            self._forget_job(record)
            raise
        handles = [WorkerHandle(f"{role}/{i}", role, i) for i in range(len(specs))]
        r = WorkerRole(role, "process", [h.id for h in handles], spec)
        self._register_role(r, handles)
        return r.worker_ids

    @property
    def _job_prefix(self) -> str:
        """How the names of this trial's jobs start (``{exp}_{trial}:{role}``)."""
        return f"{self.experiment_name}_{self.trial_name}:"

    def _clear_leftovers(self) -> None:
        """Before the first sbatch: cancel the jobs a dead controller of this trial left.

        Raises ``SchedulerError`` (and submits nothing) when their controller still runs
        or cannot be told; the check is then repeated on the next submission.
        """
        with self._lock:
            if self._leftovers_cleared:
                return
            user = pwd.getpwuid(os.getuid()).pw_name
            leftovers = find_leftovers(self._slurm, user, self._job_prefix)
            if leftovers:
                trial = f"{self.experiment_name}/{self.trial_name}"
                ended = ended_controllers(leftovers, self.controller_job, self._slurm, trial)
                logger.warning(
                    "Trial %s: cancelling Slurm job(s) %s left by controller job(s) %s",
                    trial,
                    ", ".join(job.job_id for job in leftovers),
                    ", ".join(f"{job_id} ({end})" for job_id, end in ended.items()),
                )
                self._cancel([_JobRef(job.job_id, job.name) for job in leftovers], wait=True)
            self._leftovers_cleared = True

    def _submit(self, role: str, script: Path, resources: SlurmResources) -> str:
        result = self._slurm("sbatch", "--parsable", str(script), check=False, timeout=60)
        job_id = result.stdout.strip().split(";")[0]
        if result.returncode != 0 or not job_id.isdigit():
            raise WorkerCreationError(
                f"sbatch rejected role {role!r} ({_describe(resources)}): "
                f"{(result.stderr or result.stdout).strip()}; script: {script}"
            )
        return job_id

    def _nodes_of(self, target: WorkerRole) -> list[str]:
        """Host names of the nodes running ``target``'s workers (waits until they run)."""
        while target.kind != "process":
            target = self._role(target.target)
        self.get_workers(target.name)
        record = self._jobs[target.name]
        return self._hostnames(self._status(record, fresh=True).nodes)

    def _hostnames(self, hostlist: str) -> list[str]:
        if not hostlist:
            return []
        return self._slurm("scontrol", "show", "hostnames", hostlist).stdout.split()

    def _fork_interpreter(self, target: WorkerRole) -> str:
        # a forked worker runs in the target's container: use the interpreter its spec names
        cmd = shlex.split(target.spec.cmd or RPC_SERVER_CMD)
        return cmd[0] if os.path.basename(cmd[0]).startswith("python") else sys.executable

    # --- job state ---

    def _status(self, record: _JobRef, fresh: bool = False) -> JobStatus:
        with self._status_lock:
            now = time.monotonic()
            if not fresh and record.status and now - record.checked_at < self.status_ttl:
                return record.status
            try:
                result = self._slurm(
                    "squeue",
                    "--noheader",
                    "--states=all",
                    f"--jobs={record.job_id}",
                    "--format=%T|%r|%N|%P",
                    check=False,
                    timeout=10.0,
                )
            except SchedulerError as e:
                result = subprocess.CompletedProcess([], 1, "", str(e))
            line = result.stdout.strip().splitlines()[:1]
            if result.returncode == 0 and line:
                status = JobStatus(*[*line[0].split("|"), "", "", ""][:4])
            elif result.returncode == 0 or "Invalid job id" in result.stderr:
                status = JobStatus("GONE")
            else:  # slurmctld busy or unreachable: do not declare the workers dead
                logger.warning("squeue for job %s failed: %s", record.job_id, result.stderr.strip())
                status = record.status or JobStatus("UNKNOWN")
            record.status, record.checked_at = status, now
            return status

    def _check_started(self, h: WorkerHandle) -> None:
        record = self._jobs.get(h.role)
        if record is None:
            raise WorkerFailedError(h.id, None, "its Slurm job was deleted")
        status = self._status(record)
        self._raise_if_stuck(record, status)
        if status.state not in ALIVE_STATES:
            log = read_log_tail(self.log_dir / f"{h.role}.log")
            detail = f"Slurm job {record.job_id} ({record.name}) is {status.state}"
            if status.reason and status.reason != "None":
                detail += f" (reason {status.reason})"
            raise WorkerFailedError(h.id, self._exit_code(record), f"{detail}\n{log}")

    def _raise_if_stuck(self, record: _SlurmJob, status: JobStatus) -> None:
        """Cancel and raise when ``record`` is PENDING on a request that can never be met."""
        if status.state != "PENDING":
            return
        reason = status.reason.split(",")[0]
        capacity = None
        if (reason in NEVER_STARTS or reason in CAPACITY_REASONS) and not record.capacity_checked:
            record.capacity_checked = True  # node sizes do not change while we wait
            capacity = self._capacity_problem(record, status.partition)
        detail = capacity or NEVER_STARTS.get(reason)
        if detail is None:
            return
        self._cancel([record], wait=False)
        raise WorkerCreationError(
            f"Slurm job {record.job_id} ({record.name}) for role {record.role!r} can never "
            f"start: it is PENDING with reason {status.reason}: {detail}. It asks for "
            f"{_describe(record.resources)}. The job was cancelled; lower the role's "
            "scheduling_spec (cpu, mem, gpu) or replicas, or fix nodelist/exclude."
        )

    def _capacity_problem(self, record: _SlurmJob, partition: str) -> str | None:
        result = self._slurm(
            "sinfo",
            "--noheader",
            "--Node",
            f"--partition={partition}",
            "--format=%N|%c|%m|%G",
            check=False,
        )
        if result.returncode != 0:
            return None
        return capacity_problem(
            record.resources, result.stdout.splitlines(), partition, self._hostnames
        )

    def _exit_code(self, record: _SlurmJob) -> int | None:
        result = self._slurm("scontrol", "--oneliner", "show", "job", record.job_id, check=False)
        m = re.search(r"\bExitCode=(\d+):(\d+)", result.stdout)
        if not m:
            return None
        code, signal_number = int(m.group(1)), int(m.group(2))
        return -signal_number if signal_number else code

    def _pending_hint(self, r: WorkerRole) -> str:
        record = self._jobs.get(r.name)
        if record is None:
            return ""
        status = self._status(record, fresh=True)
        hint = f"; Slurm job {record.job_id} is {status.state}"
        if status.state == "PENDING":
            hint += f" (reason {status.reason}; time in the queue counts against the timeout)"
        return hint

    # --- stopping ---

    def _stop_started(self, r: WorkerRole, handles: list[WorkerHandle]) -> None:
        record = self._jobs.get(r.name)
        if record is not None:
            self._cancel([record], wait=True)
            self._forget_job(record)

    def _cancel(self, jobs: Sequence[_JobRef], wait: bool) -> None:
        """``scancel`` (SIGTERM, so workers shut down in order); SIGKILL after the grace."""
        self._slurm("scancel", *(job.job_id for job in jobs), check=False)
        if not wait:
            return
        active = self._wait_ended(jobs, self.stop_grace)
        if not active:
            return
        ids = [job.job_id for job in active]
        logger.warning(
            "Slurm job(s) %s still active after %.0fs; killing them",
            ", ".join(ids),
            self.stop_grace,
        )
        self._slurm("scancel", "--signal=KILL", "--full", *ids, check=False)
        for job in self._wait_ended(active, KILL_WAIT):
            logger.warning("Slurm job %s did not end after SIGKILL", job.job_id)

    def _wait_ended(self, jobs: Sequence[_JobRef], timeout: float) -> list[_JobRef]:
        """Wait up to ``timeout`` seconds for ``jobs`` to end; return those still active."""
        deadline = time.monotonic() + timeout
        active = list(jobs)
        while True:
            active = [job for job in active if self._status(job, fresh=True).state in ACTIVE_STATES]
            if not active or time.monotonic() > deadline:
                return active
            time.sleep(0.2)

    def _forget_job(self, record: _SlurmJob) -> None:
        record.secrets_file.unlink(missing_ok=True)
        with self._lock:
            if self._jobs.get(record.role) is record:
                del self._jobs[record.role]

    def _emergency_stop(self) -> None:
        """Cancel every job at once (controller exit or signal); no RPCs, no waiting."""
        with self._lock:
            job_ids = [record.job_id for record in self._jobs.values()]
            self._jobs.clear()
            self._handles.clear()
            self._roles.clear()
        if job_ids:
            with contextlib.suppress(SchedulerError):
                self._slurm("scancel", *job_ids, check=False)
        self._remove_secrets()

    # --- Slurm commands ---

    @staticmethod
    def _slurm(
        *args: str, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client with the submit environment, minus what workers must not get.

        sbatch stores the exported environment with the job (readable by Slurm admins), so
        secrets never travel this way: the RPC token goes through a mode-0600 file, and
        credentials (``SECRET_ENV_VARS``: Arena tokens, the proxy admin key...) are sourced
        by the workers from ``$ARENA_CREDENTIALS_FILE`` (``additional_bash_cmds``).
        """
        withheld = {RPC_TOKEN_ENV, API_KEY_ENV, PARENT_PID_ENV, *SECRET_ENV_VARS}
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in withheld and not k.startswith(SECRET_ENV_PREFIX)
        }
        try:
            result = subprocess.run(
                list(args),
                env=env,
                cwd=os.getcwd(),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SchedulerError(f"{shlex.join(args)} failed: {e}") from e
        if check and result.returncode != 0:
            raise SchedulerError(f"{shlex.join(args)} failed: {result.stderr.strip()}")
        return result


def capacity_problem(
    resources: SlurmResources,
    sinfo_lines: Iterable[str],
    partition: str,
    hostnames: Callable[[str], list[str]],
) -> str | None:
    """Why no set of the partition's nodes can ever hold ``resources`` (None if some can).

    ``sinfo_lines`` are ``%N|%c|%m|%G`` rows (node, CPUs, memory in MB, gres), one per
    node; ``hostnames`` expands a Slurm host list such as ``node[1-3]``.
    """
    nodes: dict[str, tuple[int, int, int]] = {}
    for line in sinfo_lines:
        parts = line.strip().split("|")
        if len(parts) == 4:
            nodes[parts[0]] = (_int(parts[1]), _int(parts[2]), _gpu_count(parts[3]))
    if not nodes:
        return None
    r = resources
    need = (r.cpus_per_node, r.mem_per_node_mb, r.gres_gpus_per_node)

    def fits(name: str) -> bool:
        return all(have >= want for have, want in zip(nodes[name], need))

    wanted = f"{need[0]} CPUs, {need[1]} MB memory and {need[2]} GPUs"
    if r.nodelist:
        required = hostnames(r.nodelist)
        unknown = [n for n in required if n not in nodes]
        if unknown:
            return f"nodelist names {', '.join(unknown)}, not in partition {partition}"
        small = [n for n in required if not fits(n)]
        if small:
            return f"nodelist node(s) {', '.join(small)} have less than {wanted}"
    candidates = set(nodes) - set(hostnames(r.exclude) if r.exclude else [])
    fitting = [n for n in candidates if fits(n)]
    if len(fitting) >= r.nodes:
        return None
    biggest = max(nodes.values())
    return (
        f"partition {partition} has {len(fitting)} node(s) with at least {wanted} and the job "
        f"needs {r.nodes} (its largest node has {biggest[0]} CPUs, {biggest[1]} MB, "
        f"{biggest[2]} GPUs)"
    )


def _int(text: str) -> int:
    m = re.match(r"\d+", text.strip())
    return int(m.group()) if m else 0


def _gpu_count(gres: str) -> int:
    """GPUs in a gres string such as ``gpu:8`` or ``gpu:h200:8(S:0-1),shard:4``."""
    return sum(int(m.group(1)) for m in re.finditer(r"\bgpu(?::[^:,(]+)?:(\d+)", gres))


def _describe(r: SlurmResources) -> str:
    text = (
        f"{r.nodes} node(s) x {r.ntasks_per_node} task(s) x {r.cpus_per_task} CPU(s), "
        f"{r.mem_per_node_mb} MB per node"
    )
    if r.gres_gpus_per_node:
        text += f", {r.gres_gpus_per_node} GPU(s) per node"
    return text


_LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay"})


def _warn_if_local_storage(what: str, path: str) -> None:
    """Workers on other nodes read ``path``: warn when it sits on a local filesystem."""
    target = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1]
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, fstype = mount, fields[2]
    except OSError:
        return
    if fstype in _LOCAL_FILESYSTEMS:
        logger.warning(
            "%s %s is on a local %s filesystem: workers on other nodes will not see it "
            "(fine on a single-node cluster)",
            what,
            path,
            fstype,
        )
