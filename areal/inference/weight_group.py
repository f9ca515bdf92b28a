"""The embedded server's ranks in the trainer's weight-update group, joined as SGLang does.

SGLang's ``/init_weights_update_group`` makes every scheduler process of a server join
with ``rank = rank_offset + tp_rank``: a TCP rendezvous at ``master_address:master_port``
(the trainer, rank 0, hosts the store), a ``PrefixStore`` named after the group, then
PyTorch's ``_new_process_group_helper``, which prefixes the keys again with ``"<group>/"``
and ``"<device>/"``. No collective runs while joining; the first broadcast of
``/update_weights_from_distributed`` connects an NCCL communicator (gloo connects while
the group is built, so every rank of a server joins on its own thread).

This server runs the model on one device, but it joins with as many ranks as its
``--tp-size`` says, as a TP server would: rank 0 through the same helper SGLang calls; the
others, which SGLang would run in their own processes, build the same backend on the same
store keys here (one process cannot register a group name twice). Every rank receives
every broadcast; rank 0's tensors are loaded.
"""

from __future__ import annotations

import concurrent.futures
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["WeightUpdateRanks", "join_weight_update_group"]


@dataclass
class _Rank:
    rank: int
    device: torch.device
    group: object  # a ProcessGroup (TP rank 0) or a bare backend (the others)


class WeightUpdateRanks:
    """This server's TP ranks in one weight-update group."""

    def __init__(self, group_name: str, ranks: list[_Rank]):
        self.group_name = group_name
        self._ranks = ranks
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(ranks), thread_name_prefix=f"{group_name}-rank"
        )

    @property
    def ranks(self) -> list[int]:
        return [r.rank for r in self._ranks]

    def receive(
        self, shapes: list[list[int]], dtypes: list[torch.dtype], timeout_s: float
    ) -> list[torch.Tensor]:
        """One bucket broadcast from rank 0: every TP rank receives; rank 0's copy returned."""

        def run(r: _Rank) -> list[torch.Tensor]:
            if r.device.type == "cuda":
                torch.cuda.set_device(r.device)  # the current device is per thread
            out = []
            for shape, dtype in zip(shapes, dtypes, strict=True):
                tensor = torch.empty(shape, dtype=dtype, device=r.device)
                options = dist.BroadcastOptions()
                options.rootRank = 0
                options.rootTensor = 0
                r.group.broadcast([tensor], options).wait()
                out.append(tensor)
            return out

        futures = [self._pool.submit(run, r) for r in self._ranks]
        results = [f.result(timeout=timeout_s) for f in futures]
        return results[0]

    def destroy(self) -> None:
        head = self._ranks[0].group
        if isinstance(head, dist.ProcessGroup) and head in c10d._world.pg_names:
            dist.destroy_process_group(head)
        self._pool.shutdown(wait=False)


def join_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str,
    devices: list[torch.device],
    timeout_s: float = 600.0,
) -> WeightUpdateRanks:
    """Join with ``len(devices)`` TP ranks ``rank_offset + tp_rank`` (concurrently)."""
    if rank_offset < 1 or rank_offset + len(devices) > world_size:
        raise ValueError(
            f"ranks {rank_offset}..{rank_offset + len(devices) - 1} do not fit a group of "
            f"world size {world_size} whose rank 0 is the trainer"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    init_method = f"tcp://{master_address}:{int(master_port)}"

    def join(tp_rank: int) -> _Rank:
        rank = rank_offset + tp_rank
        store, _, _ = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = dist.PrefixStore(group_name, store)
        if tp_rank == 0:
            group, _ = c10d._new_process_group_helper(
                world_size,
                rank,
                [],
                c10d.Backend(backend),
                store,
                group_name=group_name,
                timeout=timeout,
            )
            c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        else:
            group = _same_keys_backend(backend, store, group_name, rank, world_size, timeout)
        return _Rank(rank, devices[tp_rank], group)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(devices)) as pool:
        ranks = list(pool.map(join, range(len(devices))))
    return WeightUpdateRanks(group_name, ranks)


def _same_keys_backend(
    backend: str,
    store: dist.Store,
    group_name: str,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
):
    """The backend ``_new_process_group_helper`` would build for this rank, on its keys."""
    device_type = "cuda" if backend == "nccl" else "cpu"
    keys = dist.PrefixStore(f"{device_type}/", dist.PrefixStore(f"{group_name}/", store))
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(keys, rank, world_size, options)
    return dist.ProcessGroupGloo(keys, rank, world_size, timeout=timeout)
