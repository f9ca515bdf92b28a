"""A stand-alone NCCL group between a trainer rank and inference servers, for weight sync.

Training ranks already belong to a default process group, and inference servers belong
to none; the weight-update group spans one trainer rank (rank 0, which hosts the
rendezvous store) and every server rank, so it is built directly from a TCP store rather
than through ``init_process_group``. Both sides call :func:`create_group` with the same
address, port, world size and group name.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = ["broadcast", "create_group"]

_STORES: list[dist.TCPStore] = []


def create_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group; the caller's current CUDA device is used."""
    if not torch.cuda.is_available():
        raise RuntimeError("NCCL weight sync needs CUDA; use weight_update_mode=disk on CPU")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    # create the communicator now, so that a broken setup fails here and not mid-update
    probe = torch.zeros(1, device=torch.cuda.current_device())
    broadcast(group, probe, src=0)
    torch.cuda.synchronize()
    _STORES.append(store)  # the store (and, on rank 0, its server) must outlive the group
    return group


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = src
    options.rootTensor = 0
    group.broadcast([tensor], options).wait()
