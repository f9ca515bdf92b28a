"""How many nodes a role's GPU workers take on a cluster scheduler (Slurm, Ray).

Both place a role's consecutive ranks in equal blocks, one block per node, as Slurm's block
distribution does: the ``t`` actor workers whose devices one TP server spans then share a
host. A worker never spans nodes, and the replicas must split evenly over the nodes.
"""

from __future__ import annotations

import math

from areal.infra.scheduler.exceptions import WorkerConfigurationError

__all__ = ["gpu_nodes"]


def gpu_nodes(role: str, gpus_per_worker: int, replicas: int, n_gpus_per_node: int) -> int:
    """The nodes ``replicas`` workers of ``gpus_per_worker`` GPUs each fill, or a
    :class:`WorkerConfigurationError` naming ``role`` and the fix."""
    if n_gpus_per_node <= 0:
        raise WorkerConfigurationError(
            f"role {role!r} asks for {gpus_per_worker} GPU(s) per worker but "
            "cluster.n_gpus_per_node is 0; set it to the GPUs of one node of the cluster"
        )
    if gpus_per_worker > n_gpus_per_node:
        raise WorkerConfigurationError(
            f"role {role!r}: a worker asks for {gpus_per_worker} GPUs but a node has "
            f"{n_gpus_per_node} (cluster.n_gpus_per_node); a worker cannot span nodes"
        )
    nodes = math.ceil(gpus_per_worker * replicas / n_gpus_per_node)
    if replicas % nodes:
        raise WorkerConfigurationError(
            f"role {role!r}: {replicas} workers x {gpus_per_worker} GPU(s) need {nodes} nodes "
            f"of {n_gpus_per_node} GPUs, but {replicas} replicas cannot be spread evenly over "
            f"{nodes} nodes; use a replica count divisible by {nodes}"
        )
    return nodes
