"""``TrainController``: the controller side of a data-parallel train engine (§7.7).

Creates one worker per rank, sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
in each, creates the engine, and calls methods on all ranks concurrently. Batches are
lists of trajectory dicts (one per rollout group, ``[n, L]`` tensors): a call splits the
list over ranks by balanced token count (a group never straddles ranks), concatenates
each rank's share into one padded batch, and splits the results back per group, in the
original order. On the controller the data-parallel view is one rank, so the dataloader
is not sharded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any

import torch

from areal.api.cli_args import SchedulingSpec, SchedulingStrategy
from areal.api.io_struct import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta
from areal.api.scheduler_api import Job, Scheduler, Worker
from areal.utils import logging
from areal.utils.data import concat_padded_tensors

__all__ = ["TrainController", "balanced_partition"]

logger = logging.getLogger("train.controller")

SPLIT_BACK = ("compute_logp", "compute_advantages")


def balanced_partition(sizes: list[int], parts: int) -> list[list[int]]:
    """Greedy longest-first assignment of items to the currently lightest part."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        p = min(range(parts), key=lambda k: (loads[k], k))
        out[p].append(i)
        loads[p] += sizes[i]
    return [sorted(group) for group in out]


def _tokens(trajectory: dict[str, torch.Tensor]) -> int:
    return int(trajectory["attention_mask"].sum())


class TrainController:
    def __init__(self, engine_class: str, config: Any, scheduler: Scheduler, role: str = "actor"):
        self.engine_class = engine_class
        self.config = config
        self.scheduler = scheduler
        self.role = role
        self.workers: list[Worker] = []

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
        for rank, worker in enumerate(self.workers):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": "0",
                "MASTER_ADDR": master.ip,
                "MASTER_PORT": str(port),
            }
            asyncio.run(self.scheduler.set_worker_env(worker.id, env))
            asyncio.run(
                self.scheduler.create_engine(worker.id, self.engine_class, worker.id, self.config)
            )
        self._on_all("create_process_group")
        self._on_all("initialize", ft_spec=ft_spec)
        logger.info("%s: %d rank(s) ready", self.role, world_size)

    def destroy(self) -> None:
        try:
            self._on_all("destroy")
        except Exception as e:
            logger.warning("destroying %s engines failed: %s", self.role, e)
        self.scheduler.delete_workers(self.role)

    # --- calls ---

    def _call(self, worker: Worker, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.scheduler.call_engine(worker.id, method, *args, engine_name=worker.id, **kwargs)

    def _on_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """The same call on every rank, concurrently (collectives need all of them)."""
        if not self.workers:
            return []
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.workers)) as pool:
            futures = [pool.submit(self._call, w, method, *args, **kwargs) for w in self.workers]
            return [f.result() for f in futures]

    def _dispatch(self, method: str, batch: list[dict[str, torch.Tensor]], **kwargs: Any):
        """Split ``batch`` over ranks, call ``method`` on each share, gather per group."""
        parts = balanced_partition([_tokens(t) for t in batch], len(self.workers))
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.workers)) as pool:
            futures = []
            for worker, part in zip(self.workers, parts, strict=True):
                share = concat_padded_tensors([batch[i] for i in part])
                extra = dict(kwargs)
                if method == "compute_advantages":
                    extra["group_sizes"] = [batch[i]["attention_mask"].shape[0] for i in part]
                futures.append(pool.submit(self._call, worker, method, share, **extra))
            results = [f.result() for f in futures]
        if method not in SPLIT_BACK:
            return results
        out: list[Any] = [None] * len(batch)
        for part, result in zip(parts, results, strict=True):
            row = 0
            for i in part:
                n, width = batch[i]["attention_mask"].shape
                out[i] = _slice_rows(result, row, n, width)
                row += n
        return out

    # --- the actor interface used by the trainer ---

    def compute_logp(self, batch: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        return self._dispatch("compute_logp", batch)

    def compute_advantages(self, batch: list[dict[str, torch.Tensor]]) -> list[dict]:
        return self._dispatch("compute_advantages", batch)

    def ppo_update(self, batch: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
        per_rank = self._dispatch("ppo_update", batch)
        return [stats for rank_stats in per_rank if rank_stats for stats in rank_stats]

    def step_lr_scheduler(self) -> None:
        self._on_all("lr_scheduler_step")

    def connect_engine(self, rollout: Any, meta: WeightUpdateMeta) -> None:
        self._on_all("connect_engine", rollout.callback(), meta)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        self._on_all("update_weights", meta)

    def set_version(self, version: int) -> None:
        self._on_all("set_version", version)

    def get_version(self) -> int:
        return self._call(self.workers[0], "get_version")

    def save(self, meta: SaveLoadMeta) -> None:
        self._on_all("save", _without_tokenizer(meta))

    def load(self, meta: SaveLoadMeta) -> None:
        self._on_all("load", _without_tokenizer(meta))

    def export_stats(self) -> dict[str, float]:
        stats = self._on_all("export_stats")
        return stats[0] if stats else {}

    def should_compute_prox_logp(self) -> bool:
        return self.config.should_compute_prox_logp()


def _without_tokenizer(meta: SaveLoadMeta) -> SaveLoadMeta:
    """Tokenizers do not travel over RPC; each rank saves the one it loaded itself."""
    return dataclasses.replace(meta, tokenizer=None) if meta.tokenizer is not None else meta


def _slice_rows(result: Any, start: int, n: int, width: int) -> Any:
    """Rows ``start:start+n`` of a rank's result, trimmed back to the group's width."""
    if isinstance(result, torch.Tensor):
        part = result[start : start + n]
        return part[:, :width] if part.dim() >= 2 else part
    if isinstance(result, dict):
        return {k: _slice_rows(v, start, n, width) for k, v in result.items()}
    raise TypeError(f"cannot split a {type(result).__name__} result back into groups")
