"""Worker resource requests (``SchedulingSpec``) and placement (``SchedulingStrategy``)."""

from __future__ import annotations

from dataclasses import dataclass

from areal.api.config.fields import ConfigNode, FieldError, cfg_field

__all__ = ["RPC_SERVER_CMD", "SchedulingSpec", "SchedulingStrategy"]

RPC_SERVER_CMD = "python -m areal.infra.rpc.rpc_server"


@dataclass
class SchedulingSpec(ConfigNode):
    """Resources and launch command of one worker (one engine process)."""

    cpu: int = cfg_field(8, help="CPU cores per GPU (rollout workers multiply by tp x pp).")
    gpu: int = cfg_field(0, help="GPUs per worker; rollout workers get tp x pp.")
    mem: int = cfg_field(32, help="Host memory per GPU in GB (Slurm requests mem x 1024 MB).")
    port_count: int = cfg_field(
        2, help="Ports reserved per worker; the first is the RPC port, the second MASTER_PORT."
    )
    image: str = cfg_field(
        "/storage/openpsi/images/areal-latest.sif", help="Container image for Slurm workers."
    )
    task_type: str = cfg_field("worker", help="Kind of task; 'worker' hosts an RPC server.")
    env_vars: dict[str, str] = cfg_field(
        factory=dict, help="Extra environment for the worker (values may use worker-side $VARS)."
    )
    cmd: str | None = cfg_field(
        None, help="Worker command; engines default it to the RPC server module."
    )
    srun_additional_args: str = cfg_field(
        "--unbuffered --mpi=pmi2 -K --chdir $PWD",
        help="Extra srun arguments for the worker step (quoted; $VARS expand on the node).",
    )
    additional_bash_cmds: list[str] | None = cfg_field(
        None, help="Shell commands run inside the container before cmd (e.g. source creds)."
    )
    container_type: str = cfg_field(
        "apptainer",
        help="apptainer: run in the image with $AREAL_CONTAINER_BIN; none: run on the host.",
        choices=("apptainer", "none"),
    )
    mount: str = cfg_field(
        "/storage:/storage", help="Comma-separated container binds (one --bind each)."
    )
    nodelist: str | None = cfg_field(None, help="sbatch --nodelist.")
    exclude: str | None = cfg_field(None, help="sbatch --exclude.")
    reservation: str | None = cfg_field(None, help="sbatch --reservation.")
    exclusive: bool = cfg_field(False, help="sbatch --exclusive.")
    ray_placement_strategy: str | None = cfg_field(None, help="Deprecated; ignored.")

    def validate(self) -> None:
        for name in ("cpu", "gpu", "mem", "port_count"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"must be >= 0 (got {getattr(self, name)})")
        if self.port_count < 1:
            raise FieldError("port_count", "a worker needs at least one port for its RPC server")


@dataclass
class SchedulingStrategy(ConfigNode):
    """Whether a role gets its own GPUs or shares another role's nodes."""

    type: str = cfg_field(
        "separation",
        help="'separation' (own GPUs) or 'colocation' (on the target role's GPUs).",
        choices=("separation", "colocation"),
    )
    target: str | None = cfg_field(None, help="Role to colocate with (e.g. 'actor').")
    fork: bool = cfg_field(
        True, help="Colocated role gets new processes on the target's nodes (not shared ones)."
    )

    def validate(self) -> None:
        if self.type == "colocation" and not self.target:
            raise FieldError("target", "colocation needs a target role, e.g. target: actor")
