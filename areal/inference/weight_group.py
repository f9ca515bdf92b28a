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

A join is bounded: it fails after ``timeout_s`` (the server's
``--weight-update-group-timeout``) when the trainer's store or a peer never answers, and
it runs on daemon threads (:func:`start_weight_update_group_join`), so the server's
generation loop goes on meanwhile and a pending join never holds up the process's exit.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = [
    "BROADCAST_TIMEOUT_S",
    "JOIN_TIMEOUT_S",
    "WeightUpdateRanks",
    "join_weight_update_group",
    "start_weight_update_group_join",
]

JOIN_TIMEOUT_S = 60.0
"""Seconds a join may take by default (``rollout.weight_update_group_timeout``)."""
BROADCAST_TIMEOUT_S = 600.0
"""Seconds one bucket broadcast may take once the group is formed."""


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
        _destroy_group(self._ranks[0].group)
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
    timeout_s: float = JOIN_TIMEOUT_S,
) -> WeightUpdateRanks:
    """Join with ``len(devices)`` TP ranks ``rank_offset + tp_rank``; blocks until joined.

    Raises ``ValueError`` for ranks that do not fit ``world_size``, ``TimeoutError`` when
    the group has not formed within ``timeout_s``, and the join's own error otherwise.
    """
    joining = start_weight_update_group_join(
        master_address=master_address,
        master_port=master_port,
        rank_offset=rank_offset,
        world_size=world_size,
        group_name=group_name,
        backend=backend,
        devices=devices,
        timeout_s=timeout_s,
    )
    return joining.result()


def start_weight_update_group_join(
    *,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str,
    devices: list[torch.device],
    timeout_s: float = JOIN_TIMEOUT_S,
) -> concurrent.futures.Future:
    """Start joining (every TP rank concurrently, on daemon threads); returns at once.

    The future resolves to :class:`WeightUpdateRanks`, or fails after ``timeout_s`` at
    the latest. Cancelling it abandons the join: ranks that connect later are destroyed.
    Raises ``ValueError`` at once for ranks that do not fit ``world_size``.
    """
    if rank_offset < 1 or rank_offset + len(devices) > world_size:
        raise ValueError(
            f"ranks {rank_offset}..{rank_offset + len(devices) - 1} do not fit a group of "
            f"world size {world_size} whose rank 0 is the trainer"
        )
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    joined: concurrent.futures.Future = concurrent.futures.Future()
    init_method = f"tcp://{master_address}:{int(master_port)}"
    join_timeout = datetime.timedelta(seconds=timeout_s)
    broadcast_timeout = datetime.timedelta(seconds=max(timeout_s, BROADCAST_TIMEOUT_S))

    def join(tp_rank: int) -> _Rank:
        rank = rank_offset + tp_rank
        store, _, _ = next(c10d.rendezvous(init_method, rank, world_size, timeout=join_timeout))
        store.set_timeout(join_timeout)  # how long forming the group may wait for peers
        keys = dist.PrefixStore(group_name, store)
        if tp_rank == 0:
            group, _ = c10d._new_process_group_helper(
                world_size,
                rank,
                [],
                c10d.Backend(backend),
                keys,
                group_name=group_name,
                timeout=broadcast_timeout,
            )
            c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        else:
            group = _same_keys_backend(
                backend, keys, group_name, rank, world_size, broadcast_timeout
            )
        # NCCL reads its id from the store at the first broadcast, which may come late
        store.set_timeout(broadcast_timeout)
        return _Rank(rank, devices[tp_rank], group)

    def supervise() -> None:
        started = time.monotonic()
        ranks = [
            _in_daemon(join, tp_rank, f"{group_name}-join{tp_rank}")
            for tp_rank in range(len(devices))
        ]
        done, pending = concurrent.futures.wait(
            ranks, timeout=timeout_s, return_when=concurrent.futures.FIRST_EXCEPTION
        )
        failed = [f.exception() for f in done if f.exception() is not None]
        if failed or pending:
            for rank in ranks:  # those that connected, now or later, are let go
                rank.add_done_callback(_destroy_joined_rank)
            if failed:
                error: BaseException = failed[0]
            else:
                error = TimeoutError(
                    f"{len(pending)} of {len(ranks)} ranks had not joined group {group_name!r} "
                    f"at {init_method} after {time.monotonic() - started:.1f} s (timeout "
                    f"{timeout_s:g} s): is the trainer's rendezvous reachable?"
                )
            if joined.set_running_or_notify_cancel():
                joined.set_exception(error)
            return
        group = WeightUpdateRanks(group_name, [f.result() for f in ranks])
        if joined.set_running_or_notify_cancel():
            joined.set_result(group)
        else:  # abandoned while joining
            group.destroy()

    threading.Thread(target=supervise, name=f"{group_name}-join", daemon=True).start()
    return joined


def _in_daemon(fn: Callable[..., Any], arg: Any, name: str) -> concurrent.futures.Future:
    """``fn(arg)`` on a daemon thread (a pool's threads would be joined at exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(arg))
        except BaseException as e:  # reported through the future
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _destroy_joined_rank(future: concurrent.futures.Future) -> None:
    if future.exception() is None:
        _destroy_group(future.result().group)


def _destroy_group(group: object) -> None:
    if isinstance(group, dist.ProcessGroup) and group in c10d._world.pg_names:
        dist.destroy_process_group(group)


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
