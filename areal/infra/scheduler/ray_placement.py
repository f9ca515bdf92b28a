"""Where a role's Ray actors go: placement-group bundles, names and the cluster's address.

Pure functions of a ``SchedulingSpec`` and a few settings (no ``ray`` import), so the plan
is unit-tested without a cluster. A role's workers keep the layout they get on Slurm:

* a GPU role fills nodes of ``cluster.n_gpus_per_node`` GPUs block by block: worker ``i``
  shares a node with the other workers of its block (``ceil(gpu x replicas / n_gpus)``
  blocks of equal size), so the ``t`` consecutive actor workers whose devices one TP
  server spans are on one host. Each block is a ``STRICT_PACK`` placement group;
* a CPU role is one ``PACK`` group: on as few nodes as the cluster allows.

Each worker is one bundle of its spec's CPUs, GPUs and memory (``mem`` GB, as Slurm
requests ``mem x 1024`` MB), and its actor asks for exactly that bundle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from areal.api.cli_args import SchedulingSpec
from areal.infra.scheduler.exceptions import SchedulerError
from areal.infra.scheduler.node_layout import gpu_nodes

__all__ = [
    "RAY_ADDRESS_ENV",
    "RayBlock",
    "RayPlacement",
    "plan_placement",
    "ray_address",
    "ray_namespace",
    "worker_resources",
]

RAY_ADDRESS_ENV = "RAY_ADDRESS"
GIB = 1024**3

PlacementStrategy = Literal["PACK", "STRICT_PACK"]


@dataclass(frozen=True)
class RayBlock:
    """One placement group: ``size`` bundles of ``bundle`` for workers ``first..first+size``."""

    first: int
    size: int
    strategy: PlacementStrategy

    @property
    def workers(self) -> range:
        return range(self.first, self.first + self.size)


@dataclass(frozen=True)
class RayPlacement:
    """A role's placement groups and what each worker's actor asks for."""

    bundle: dict[str, float]
    blocks: tuple[RayBlock, ...]

    def block_of(self, index: int) -> tuple[int, int]:
        """``(block number, bundle index)`` of worker ``index``."""
        for number, block in enumerate(self.blocks):
            if index in block.workers:
                return number, index - block.first
        raise IndexError(f"worker {index} is outside the plan")


def worker_resources(spec: SchedulingSpec) -> dict[str, float]:
    """One worker's Ray resources: ``CPU`` (at least 1, as on Slurm), ``GPU`` and ``memory``
    (bytes) when asked for."""
    bundle: dict[str, float] = {"CPU": float(max(1, spec.cpu))}
    if spec.gpu > 0:
        bundle["GPU"] = float(spec.gpu)
    if spec.mem > 0:
        bundle["memory"] = float(spec.mem * GIB)
    return bundle


def plan_placement(
    spec: SchedulingSpec, replicas: int, n_gpus_per_node: int, role: str
) -> RayPlacement:
    """The placement groups of ``replicas`` workers of ``spec`` (see the module docstring)."""
    bundle = worker_resources(spec)
    if spec.gpu <= 0:
        return RayPlacement(bundle, (RayBlock(0, replicas, "PACK"),))
    nodes = gpu_nodes(role, spec.gpu, replicas, n_gpus_per_node)
    per_node = replicas // nodes
    blocks = tuple(RayBlock(n * per_node, per_node, "STRICT_PACK") for n in range(nodes))
    return RayPlacement(bundle, blocks)


def ray_namespace(experiment_name: str, trial_name: str) -> str:
    """The Ray namespace of a trial's actors (``ray list actors`` filters on it)."""
    return f"areal_{experiment_name}_{trial_name}"


def ray_address(configured: str | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """``(address, where it was set)``: ``scheduler.ray_address``, else ``$RAY_ADDRESS``.

    Refuses no address and ``local``: both would make ``ray.init`` start a private cluster
    inside the controller instead of using the real one.
    """
    for value, where in (
        (configured, "scheduler.ray_address"),
        (environ.get(RAY_ADDRESS_ENV), f"${RAY_ADDRESS_ENV}"),
    ):
        address = (value or "").strip()
        if not address:
            continue
        if address == "local":
            raise SchedulerError(
                f"{where} is 'local', which would start a new Ray cluster inside the "
                "controller; give the address of a running cluster: its GCS as host:port "
                "(e.g. 10.0.0.1:6379), 'auto' on one of its nodes, or ray://host:10001"
            )
        return address, where
    raise SchedulerError(
        "scheduler.type 'ray' uses a running Ray cluster and never starts one: set "
        f"scheduler.ray_address or ${RAY_ADDRESS_ENV} to the cluster's address (its GCS as "
        "host:port, e.g. 10.0.0.1:6379, or 'auto' on one of its nodes)"
    )
