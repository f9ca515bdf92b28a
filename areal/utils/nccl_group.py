"""The trainer's side of the weight-update group it shares with the inference servers.

Training ranks already belong to a default process group and inference servers to their
own, so the weight-update group is a separate group of ``1 + N * t`` ranks: the trainer
(rank 0, which hosts the rendezvous store) and every TP rank of the ``N`` servers. SGLang
builds its side as PyTorch builds any group: a TCP rendezvous, a ``PrefixStore`` named
after the group, then ``_new_process_group_helper``, which adds its own ``"<group>/"`` and
``"<device>/"`` prefixes. The trainer joins the same way, so both sides read and write the
same store keys, and, like SGLang, runs no collective while joining: an NCCL communicator
forms at the first broadcast; gloo (the CPU path) connects while the group is built.

``backend`` is ``"nccl"`` on GPUs and ``"gloo"`` on CPU.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["broadcast", "destroy_group", "init_weight_update_group"]


def init_weight_update_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join (rank 0: host the store of) ``group_name``. Blocks on gloo until all ranks join."""
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("an NCCL weight-update group needs CUDA; gloo is the CPU backend")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"weight-update group backend {backend!r}: use 'nccl' or 'gloo'")
    timeout = datetime.timedelta(seconds=timeout_s)
    if group_name in c10d._world.pg_names.values():  # joined before (e.g. a reconnect)
        destroy_group(next(g for g, n in c10d._world.pg_names.items() if n == group_name))
    rendezvous = c10d.rendezvous(
        f"tcp://{master_address}:{int(master_port)}", rank, world_size, timeout=timeout
    )
    store, rank, world_size = next(rendezvous)
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    # ranks of this group are its own (it is not a subgroup of the default group)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` from group rank ``src`` (the trainer sends from 0)."""
    options = dist.BroadcastOptions()
    options.rootRank = src
    options.rootTensor = 0
    group.broadcast([tensor], options).wait()


def destroy_group(group: dist.ProcessGroup) -> None:
    """Leave the group and free its name (a later join may reuse it)."""
    dist.destroy_process_group(group)
