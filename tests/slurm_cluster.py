"""A throwaway single-node Slurm cluster on localhost for tests marked ``slurm``.

:func:`start_cluster` writes a ``slurm.conf`` under a temporary directory (all state,
spool, pid and log files live there), starts ``slurmctld`` and ``slurmd`` as root with
``auth/none`` on two free ports, and waits until the node is idle. The node advertises
more CPUs than the machine has (``SlurmdParameters=config_overrides``) and every job
gets a small default memory (``DefMemPerCPU``), so several test jobs run side by side
on a 2-core machine. Clients find the cluster through ``SLURM_CONF``.

The session fixture :func:`slurm_cluster` skips (with the reason) when the daemons or
clients are not installed or the tests do not run as root (a failure when ``CI`` is set,
see tests/skip_policy.py); ``.ci/run`` installs Debian's ``slurmctld slurmd slurm-client``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from areal.utils.network import find_free_ports

__all__ = ["SlurmCluster", "slurm_cluster", "start_cluster"]

CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo", "srun")
DAEMONS = ("slurmctld", "slurmd")
START_TIMEOUT = 30.0


def find_binary(name: str) -> str | None:
    """``name`` on PATH, or in the sbin directories a non-login PATH may lack."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin:/sbin")


def missing_requirements() -> str | None:
    """Why a local cluster cannot start here (None when it can)."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if find_binary(name) is None]
    if missing:
        return (
            f"Slurm binaries not installed: {', '.join(missing)} "
            "(apt-get install slurmctld slurmd slurm-client)"
        )
    if os.geteuid() != 0:
        return "the local Slurm cluster runs slurmctld/slurmd as root; tests are not root"
    return None


@dataclass
class SlurmCluster:
    """A running cluster: its config file, node and resources, and the daemons."""

    root: Path
    conf: Path
    node: str
    cpus: int
    memory_mb: int
    partition: str
    daemons: list[subprocess.Popen]

    @property
    def env(self) -> dict[str, str]:
        """What a client's environment needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def client(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``squeue``, ``scontrol`` ...) against this cluster."""
        return subprocess.run(
            [find_binary(args[0]) or args[0], *args[1:]],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=30,
            check=check,
        )

    def job_ids(self) -> list[str]:
        """Ids of the jobs ``squeue`` lists (pending, running, completing)."""
        out = self.client("squeue", "--noheader", "--format=%i").stdout
        return out.split()

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name} ---\n" + "".join(path.read_text().splitlines(True)[-30:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, then stop both daemons (SIGTERM, SIGKILL after 10 s)."""
        if all(d.poll() is None for d in self.daemons):
            self.client("scancel", f"--partition={self.partition}", check=False)
            deadline = time.monotonic() + 10
            while self.job_ids() and time.monotonic() < deadline:
                time.sleep(0.2)
        for daemon in self.daemons:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=5)


def _config(root: Path, node: str, cpus: int, memory_mb: int, ports: list[int]) -> str:
    return f"""\
ClusterName=areal-test
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
AuthType=auth/none
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# advertise the configured CPUs (not the machine's) so test jobs run side by side
SlurmdParameters=config_overrides
# each job's memory defaults to a slice, not the whole node (jobs would run one at a time)
DefMemPerCPU=100
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
ReturnToService=2
KillWait=2
MinJobAge=300
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def start_cluster(root: Path, cpus: int = 8, memory_mb: int = 40000) -> SlurmCluster:
    """Write the config under ``root``, start both daemons, wait for an idle node."""
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (root / sub).mkdir(exist_ok=True)
    node = socket.gethostname()
    conf = root / "slurm.conf"
    conf.write_text(_config(root, node, cpus, memory_mb, find_free_ports(2)))
    daemons: list[subprocess.Popen] = []
    cluster = SlurmCluster(root, conf, node, cpus, memory_mb, "debug", daemons)
    for cmd in (
        [find_binary("slurmctld"), "-D", "-f", str(conf)],
        [find_binary("slurmd"), "-D", "-f", str(conf), "-N", node],
    ):
        daemons.append(
            subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=open(root / f"{Path(cmd[0]).name}.stderr", "w"),  # noqa: SIM115
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        state = cluster.client("sinfo", "--noheader", "--format=%T", check=False).stdout.strip()
        if state == "idle":
            return cluster
        if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
            cluster.stop()
            raise RuntimeError(
                f"local Slurm cluster not up (node state {state!r})\n{cluster.logs()}"
            )
        time.sleep(0.2)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A single-node Slurm cluster for the session; skips where it cannot run."""
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()
