"""The Ray actor behind each worker: it starts the RPC server on its node and watches it.

``WorkerHost`` is a plain class; the Ray scheduler makes it an actor class with
``ray.remote``, so this module imports without ``ray``. The actor holds the resources of
its worker's bundle, and the process it starts is the one local and Slurm workers run
(``python -m areal.infra.rpc.rpc_server``), with its output appended to the trial's
``{role}.log`` and ``merged.log`` on shared storage.

Nothing secret is an argument of the actor or part of a runtime environment, since Ray
keeps both where its dashboard and state API show them. ``WorkerLaunch.secrets_file`` is
only the path of a mode-0600 file in the trial's private secrets directory; the RPC
server loads it into its own environment and removes it at start
(``$AREAL_SECRETS_FILE``), as a forked worker does.

The server watches its host (``$AREAL_PARENT_PID``, :mod:`areal.utils.lifeline`): when
the actor dies, the server shuts down, and its inference servers and proxies with it.
"""

from __future__ import annotations

import os
import string
import sys
from dataclasses import dataclass, field
from typing import Any

from areal.infra.rpc.processes import LoggedProcess
from areal.infra.rpc.secret_env import SECRETS_FILE_ENV, public_environ

__all__ = ["WorkerHost", "WorkerLaunch"]


@dataclass(frozen=True)
class WorkerLaunch:
    """What a host actor needs to start its worker; no field holds a secret."""

    worker_id: str
    role: str
    cmd: tuple[str, ...]
    """The spec's command and the worker's identity flags (``--host``/``--port`` are added
    on the node)."""
    python_path: str
    log_dir: str
    secrets_file: str
    env_vars: dict[str, str] = field(default_factory=dict)
    """The spec's ``env_vars`` without secrets; ``$NAME`` expands against the node's
    environment."""
    cwd: str = ""
    """The controller's working directory, used where the node has it."""
    visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` for a role placed on another role's devices (None: the
    devices Ray gave the actor)."""
    host: str | None = None
    """Address the RPC server binds and advertises (None: the node's IP as Ray knows it)."""


class WorkerHost:
    """Starts one worker's RPC server on this node and answers for it (see the module
    docstring); the process starts in the constructor, so a failed start fails the
    actor's creation."""

    def __init__(self, launch: WorkerLaunch):
        self.launch = launch
        self.node_ip = launch.host or _ray_node_ip()
        cwd = launch.cwd if launch.cwd and os.path.isdir(launch.cwd) else None
        self.process = LoggedProcess(
            self.command(),
            self.environment(),
            launch.log_dir,
            launch.role,
            label=launch.worker_id,
            cwd=cwd,
        )

    def command(self) -> list[str]:
        """The worker's command line: this node's Python for a ``python ...`` command, the
        node's IP as ``--host`` unless the spec names one, and a free port."""
        cmd = list(self.launch.cmd)
        if os.path.basename(cmd[0]).startswith("python"):
            cmd[0] = sys.executable  # the interpreter Ray runs on this node
        if not any(a == "--host" or a.startswith("--host=") for a in cmd):
            cmd += ["--host", self.node_ip]
        return [*cmd, "--port", "0"]

    def environment(self) -> dict[str, str]:
        """This node's environment minus secrets, the spec's variables, and the path of the
        worker's secrets file (never the secrets themselves)."""
        env = public_environ()
        env.pop("SLURM_PROCID", None)  # would override --worker-index
        env["PYTHONPATH"] = self.launch.python_path
        env["PYTHONUNBUFFERED"] = "1"
        for name, value in self.launch.env_vars.items():
            env[name] = string.Template(value).safe_substitute(env)
        if self.launch.visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.launch.visible_devices
        env[SECRETS_FILE_ENV] = self.launch.secrets_file
        return env

    def info(self) -> dict[str, Any]:
        """The server's pid, this node's IP and Ray node id, the Python it runs and the
        devices it sees."""
        devices = self.launch.visible_devices
        if devices is None:
            devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return {
            "pid": self.process.pid,
            "ip": self.node_ip,
            "node_id": _ray_node_id(),
            "python": sys.executable,
            "visible_devices": devices,
        }

    def poll(self) -> int | None:
        """The server's exit code, None while it runs."""
        return self.process.poll()

    def tail(self) -> str:
        """The last lines the server printed."""
        return self.process.tail()

    def stop(self, grace: float) -> int | None:
        """SIGTERM the server's process tree, SIGKILL what is left after ``grace`` seconds."""
        self.process.kill_tree(grace)
        return self.process.poll()


def _ray_node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _ray_node_id() -> str | None:
    """This node's Ray id (None outside a Ray worker, e.g. in a unit test)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()
