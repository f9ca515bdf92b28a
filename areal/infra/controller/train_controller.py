"""``TrainController``: the controller side of a (model-)parallel train engine.

Creates one worker per rank, sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
in each, creates the engine, initializes it on all ranks, then asks every rank for its
data-parallel layout. Only DP heads take data: with tensor or pipeline parallelism the
ranks of one model-parallel group must see the same batch, and the worker RPC server
copies a head's arguments to the rest of its group (``broadcast_from_head``), so the other
ranks get an empty call and answer null.

Batches are lists of trajectory dicts (one per rollout group, ``[n, L]`` tensors): a call
splits the list over the DP heads by balanced token count (a group never straddles
ranks), concatenates each head's share into one padded batch, and splits the heads'
results back per group, in the original order. Every other call (weights, checkpoints,
versions, the LR step, stats) goes to every rank, since engines run collectives in them.
On the controller the data-parallel view is one rank, so the dataloader is not sharded.

Every rank is a :class:`~areal.infra.rpc.remote_engine.RemoteEngine` of
:class:`~areal.api.engine_api.PPOActorEngine`: a call the interface does not declare
fails here, before anything is sent. Calls to every rank are gathered on the RPC loop;
the first failure is raised at once (a peer may wait in a collective that can no longer
complete, and the run's teardown stops it).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from areal.api.cli_args import SchedulingSpec, SchedulingStrategy
from areal.api.engine_api import PPOActorEngine
from areal.api.io_struct import FinetuneSpec, ParamSpec, SaveLoadMeta, WeightUpdateMeta
from areal.api.scheduler_api import Job, Scheduler, Worker
from areal.engine.weight_sync import connect_weight_sync
from areal.infra.rpc.loop import run_sync
from areal.infra.rpc.remote_engine import RemoteEngine, RemoteMethod
from areal.utils import logging
from areal.utils.data import concat_padded_tensors

__all__ = ["TrainController", "balanced_partition"]

logger = logging.getLogger("train.controller")

# data calls: heads broadcast their share to their model-parallel group
BROADCAST = {"broadcast": True}
# calls answered by one rank, or with nothing to share: no collective on the worker
NO_BROADCAST = {"broadcast": False}

Rank = RemoteEngine[PPOActorEngine]


def _alone(rank: Rank) -> Rank:
    """``rank`` for a call whose arguments are not shared with its model-parallel group."""
    return rank.with_options(rpc_meta=NO_BROADCAST)


def _own_answer(rank: Rank) -> Rank:
    """:func:`_alone`, and the rank answers for itself even off the DP head."""
    return rank.with_options(rpc_meta={**NO_BROADCAST, "every_rank": True})


def balanced_partition(sizes: list[int], parts: int) -> list[list[int]]:
    """Greedy longest-first assignment of items to the currently lightest part.

    Ties go to the part with fewer items, so no part stays empty while it has at least
    as many items as parts (zero-size items included). Each part's indices are sorted.
    """
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        p = min(range(parts), key=lambda k: (loads[k], len(out[k]), k))
        out[p].append(i)
        loads[p] += sizes[i]
    return [sorted(group) for group in out]


def _tokens(trajectory: dict[str, torch.Tensor]) -> int:
    return int(trajectory["attention_mask"].sum())


class TrainController:
    """Drives the ranks of one train engine role; see the module docstring.

    After :meth:`initialize`, ``dp_size`` is the engine's data-parallel size and
    ``dp_heads`` the head worker of each DP rank, in DP-rank order.
    """

    def __init__(self, engine_class: str, config: Any, scheduler: Scheduler, role: str = "actor"):
        self.engine_class = engine_class
        self.config = config
        self.scheduler = scheduler
        self.role = role
        self.workers: list[Worker] = []
        self.ranks: list[Rank] = []  # the engine on each worker, in rank order
        self.dp_size = 0
        self.dp_heads: list[Worker] = []
        self._head_index: list[int] = []  # per DP rank: the index of its head worker
        self._dp_rank_of: list[int | None] = []  # per worker: its DP rank, None off-head
        self.weight_plan: list[list[ParamSpec]] | None = None  # xccl buckets, in send order

    # --- lifecycle ---

    def initialize(
        self,
        world_size: int,
        spec: SchedulingSpec,
        ft_spec: FinetuneSpec,
        strategy: SchedulingStrategy | None = None,
    ) -> None:
        self.scheduler.create_workers(Job(self.role, world_size, [spec] * world_size, strategy))
        self.workers = self.scheduler.get_workers(self.role)
        master = self.workers[0]
        port = master.worker_ports[1] if len(master.worker_ports) > 1 else master.worker_ports[0]

        async def create(rank: int, worker: Worker) -> None:
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": "0",
                "MASTER_ADDR": master.ip,
                "MASTER_PORT": str(port),
            }
            await self.scheduler.set_worker_env(worker.id, env)
            await self.scheduler.create_engine(worker.id, self.engine_class, worker.id, self.config)

        run_sync(_gather(create(rank, worker) for rank, worker in enumerate(self.workers)))
        self.ranks = [RemoteEngine(self.scheduler, w.id, PPOActorEngine) for w in self.workers]
        self._on_all(lambda rank: rank.create_process_group.acall())
        self._on_all(lambda rank: rank.initialize.acall(ft_spec=ft_spec))
        self._learn_layout()
        logger.info("%s: %d rank(s) ready, %d data-parallel", self.role, world_size, self.dp_size)

    def _learn_layout(self) -> None:
        """Which workers are DP heads, and of which DP rank (non-heads answer null).

        A rank that answers but is not a head would not get its head's arguments on the
        worker (the engine is not an initialized train engine there): an error, as is any
        layout other than exactly one head per DP rank.
        """
        answers = self._on_all(lambda rank: _alone(rank).data_parallel_layout.acall())
        heads = [(i, a) for i, a in enumerate(answers) if a is not None]
        head_of_rank = {int(a["dp_rank"]): i for i, a in heads}
        sizes = {int(a["dp_size"]) for _, a in heads}
        n_heads = len(heads)
        if (
            sizes != {n_heads}
            or sorted(head_of_rank) != list(range(n_heads))
            or not all(a["is_head"] for _, a in heads)
        ):
            layout = {w.id: a for w, a in zip(self.workers, answers, strict=True)}
            raise RuntimeError(
                f"{self.role}: the engines report an inconsistent data-parallel layout "
                f"(one head per DP rank expected): {layout}"
            )
        self.dp_size = n_heads
        self._head_index = [head_of_rank[r] for r in range(n_heads)]
        self.dp_heads = [self.workers[i] for i in self._head_index]
        self._dp_rank_of = [None] * len(self.workers)
        for dp_rank, i in enumerate(self._head_index):
            self._dp_rank_of[i] = dp_rank

    def destroy(self) -> None:
        try:
            self._on_all(lambda rank: rank.destroy.acall())
        except Exception as e:
            logger.warning("destroying %s engines failed: %s", self.role, e)
        self.scheduler.delete_workers(self.role)

    # --- calls ---

    def _on_all(self, call: Callable[[Rank], Awaitable[Any]]) -> list[Any]:
        """``call`` on every rank at once (collectives need all of them); results per
        worker (non-heads of an initialized engine answer None)."""
        if not self.ranks:
            return []
        return run_sync(_gather(call(rank) for rank in self.ranks))

    def _from_head(self, call: Callable[[Rank], Awaitable[Any]]) -> Any:
        """``call`` on every rank (it may be a collective), DP rank 0's answer."""
        results = self._on_all(call)
        return results[self._head_index[0]] if self._head_index else None

    def _partition(self, batch: list[dict[str, torch.Tensor]]) -> list[list[int]]:
        """Group indices per DP rank; every rank must get at least one whole group."""
        if not self.dp_heads:
            raise RuntimeError(f"{self.role}: call initialize() before sending batches")
        if len(batch) < self.dp_size:
            raise ValueError(
                f"{self.role}: the batch has {len(batch)} rollout group(s) but the engine has "
                f"{self.dp_size} data-parallel ranks, and each rank needs at least one whole "
                f"group; set train_dataset.batch_size to at least {self.dp_size} (a multiple "
                f"of the DP size {self.dp_size} balances best)"
            )
        parts = balanced_partition([_tokens(t) for t in batch], self.dp_size)
        empty = [rank for rank, part in enumerate(parts) if not part]
        if empty:  # balanced_partition avoids this; a silent empty share would hang a collective
            raise ValueError(
                f"{self.role}: data-parallel rank(s) {empty} would get no rollout group "
                f"out of {len(batch)}; set train_dataset.batch_size to a multiple of the DP "
                f"size {self.dp_size}"
            )
        return parts

    def _dispatch(
        self,
        method: Callable[[Rank], RemoteMethod],
        batch: list[dict[str, torch.Tensor]],
        share_kwargs: Callable[[list[int]], dict[str, Any]] = lambda part: {},
    ) -> tuple[list[list[int]], list[Any]]:
        """Split ``batch`` over DP heads, call ``method`` on every rank, gather from heads.

        A head gets its share (and ``share_kwargs(its group indices)``); the other ranks
        of its model-parallel group get it through the worker's broadcast. Returns each
        DP rank's group indices and its head's result, in DP-rank order.
        """
        parts = self._partition(batch)
        shares = [concat_padded_tensors([batch[i] for i in part]) for part in parts]

        def call(rank: Rank, dp_rank: int | None) -> Awaitable[Any]:
            remote = method(rank.with_options(rpc_meta=BROADCAST))
            if dp_rank is None:  # receives its head's arguments inside the worker
                return remote.follow_head()
            return remote.acall(shares[dp_rank], **share_kwargs(parts[dp_rank]))

        calls = zip(self.ranks, self._dp_rank_of, strict=True)
        by_worker = run_sync(_gather(call(rank, dp_rank) for rank, dp_rank in calls))
        return parts, [by_worker[i] for i in self._head_index]

    def _split_back(
        self,
        what: str,
        batch: list[dict[str, torch.Tensor]],
        parts: list[list[int]],
        results: list[Any],
    ) -> list[Any]:
        """The heads' ``[B, ...]`` results as one result per group of ``batch``, in its
        order."""
        out: list[Any] = [None] * len(batch)
        for dp_rank, (part, result) in enumerate(zip(parts, results, strict=True)):
            if result is None:
                raise RuntimeError(
                    f"{self.role}: the head of data-parallel rank {dp_rank} "
                    f"({self.dp_heads[dp_rank].id}) returned none of {what}"
                )
            row = 0
            for i in part:
                n, width = batch[i]["attention_mask"].shape
                out[i] = _slice_rows(result, row, n, width)
                row += n
        return out

    # --- the actor interface used by the trainer ---

    def compute_logp(self, batch: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per-group log-probs ``[n, L]`` of the current weights, in batch order."""
        parts, results = self._dispatch(lambda rank: rank.compute_logp, batch)
        return self._split_back("the log-probs", batch, parts, results)

    def compute_advantages(self, batch: list[dict[str, torch.Tensor]]) -> list[dict]:
        """Per-group trajectory dicts with ``advantages`` etc., in batch order."""

        def group_sizes(part: list[int]) -> dict[str, Any]:
            return {"group_sizes": [batch[i]["attention_mask"].shape[0] for i in part]}

        parts, results = self._dispatch(lambda rank: rank.compute_advantages, batch, group_sizes)
        return self._split_back("the advantages", batch, parts, results)

    def ppo_update(self, batch: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
        """One stats dict per optimizer step (minibatch).

        Engines reduce step statistics over the data-parallel ranks, so every head reports
        the same list; DP rank 0's is returned.
        """
        _, per_head = self._dispatch(lambda rank: rank.ppo_update, batch)
        return list(per_head[0] or [])

    def step_lr_scheduler(self) -> None:
        self._on_all(lambda rank: rank.lr_scheduler_step.acall())

    # --- weight sync: the trainer's half of the controller's handshake ---

    def connect_engine(self, rollout: Any, meta: WeightUpdateMeta) -> None:
        """Set up weight sync with a rollout controller (``xccl``: both sides join the
        group now, and ``meta`` gets its address); see :mod:`areal.engine.weight_sync`."""
        self.weight_plan = connect_weight_sync(self, rollout, meta)

    def weight_group_address(self, meta: WeightUpdateMeta) -> WeightUpdateMeta:
        """The group's address, port and backend, chosen by rank 0 (where it is hosted)."""
        return _alone(self.ranks[0]).weight_group_address(meta)

    def join_weight_group(self, meta: WeightUpdateMeta) -> None:
        self._on_all(lambda rank: _alone(rank).join_weight_group.acall(meta))

    def weight_buckets(self, meta: WeightUpdateMeta) -> list[list[ParamSpec]]:
        """Rank 0's bucket plan (producing it is a collective on every rank)."""
        return self._on_all(lambda rank: _alone(rank).weight_buckets.acall(meta))[0]

    def send_weights(self, meta: WeightUpdateMeta) -> None:
        """Every rank's half of one update (the rollout side receives meanwhile)."""
        self._on_all(lambda rank: _alone(rank).send_weights.acall(meta))

    def share_weights(self, meta: WeightUpdateMeta) -> list[list[str]]:
        """``awex``: every rank's serialized buckets, in rank order (a collective)."""
        return self._on_all(lambda rank: _own_answer(rank).share_weights.acall(meta))

    def release_shared_weights(self) -> None:
        self._on_all(lambda rank: _alone(rank).release_shared_weights.acall())

    def set_version(self, version: int) -> None:
        self._on_all(lambda rank: rank.set_version.acall(version))

    def get_version(self) -> int:
        """DP rank 0's version (one rank only, so no argument broadcast on the worker)."""
        head = self.ranks[self._head_index[0]] if self._head_index else self.ranks[0]
        return _alone(head).get_version()

    def save(self, meta: SaveLoadMeta) -> None:
        self._on_all(lambda rank: rank.save.acall(_without_tokenizer(meta)))

    def load(self, meta: SaveLoadMeta) -> None:
        self._on_all(lambda rank: rank.load.acall(_without_tokenizer(meta)))

    def export_stats(self) -> dict[str, float]:
        """The engines' stats reduced over DP (a collective on every rank), from a head."""
        return self._from_head(lambda rank: rank.export_stats.acall()) or {}

    def should_compute_prox_logp(self) -> bool:
        return self.config.should_compute_prox_logp()


async def _gather(calls: Any) -> list[Any]:
    """Every call's result, in order, or the first failure at once (the others run on)."""
    return list(await asyncio.gather(*calls))


def _without_tokenizer(meta: SaveLoadMeta) -> SaveLoadMeta:
    """Tokenizers do not travel over RPC; each rank saves the one it loaded itself."""
    return dataclasses.replace(meta, tokenizer=None) if meta.tokenizer is not None else meta


def _slice_rows(result: Any, start: int, n: int, width: int) -> Any:
    """Rows ``start:start+n`` of a head's result (``[B, L]`` or ``[B]``), trimmed back to
    the group's width ``L_group``: ``[n, L_group]`` or ``[n]``."""
    if isinstance(result, torch.Tensor):
        part = result[start : start + n]
        return part[:, :width] if part.dim() >= 2 else part
    if isinstance(result, dict):
        return {k: _slice_rows(v, start, n, width) for k, v in result.items()}
    raise TypeError(f"cannot split a {type(result).__name__} result back into groups")
