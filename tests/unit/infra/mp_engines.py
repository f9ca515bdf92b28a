"""A stand-in train engine with real model-parallel groups, for controller tests.

:class:`RecordingMPEngine` joins ``torch.distributed`` (gloo) from the ``RANK`` /
``WORLD_SIZE`` / ``MASTER_*`` environment the controller sets, and builds tensor-parallel
and data-parallel groups in Megatron's ``tp-dp`` order: rank ``r`` has TP rank
``r % tp`` and DP rank ``r // tp``, so TP groups are runs of ``tp`` consecutive ranks.
The TP group is its ``context_and_model_parallel_group``, which is what the worker RPC
server broadcasts a DP head's arguments over.

Each data method writes what it received to ``{record_dir}/{method}-{call}-rank{r}.pt``
(non-head results never come back over RPC, so files are how a test sees them) and
checks over the TP group that every rank holds the same data, as Megatron's TP layers
need. Results are simple functions of the input so a test can check the split-back.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal.api.engine_api import PPOActorEngine

__all__ = ["MPLayoutConfig", "RecordingMPEngine"]

LOGP_OFFSET = 0.5  # compute_logp returns input_ids + LOGP_OFFSET
N_MINIBATCHES = 2  # ppo_update reports this many steps


@dataclass
class MPLayoutConfig:
    """Tensor-parallel size and where ranks record their calls (travels by value)."""

    tp_size: int
    record_dir: str


class RecordingMPEngine(PPOActorEngine):
    """A train engine whose ranks form ``world // tp`` DP replicas of ``tp`` TP ranks."""

    def __init__(self, config: MPLayoutConfig):
        self.config = config
        self.initialized = False
        self._tp_group: dist.ProcessGroup | None = None
        self._dp_group: dist.ProcessGroup | None = None
        self._calls: dict[str, int] = {}
        self._version = 0

    # --- groups ---

    def create_process_group(self, parallel_strategy: Any = None) -> None:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        tp, world = self.config.tp_size, dist.get_world_size()
        if world % tp:
            raise ValueError(f"world size {world} is not a multiple of tp {tp}")
        rank = dist.get_rank()
        # every rank creates every group, in the same order (a torch.distributed rule)
        for start in range(0, world, tp):
            group = dist.new_group(list(range(start, start + tp)))
            if start <= rank < start + tp:
                self._tp_group = group
        for tp_rank in range(tp):
            group = dist.new_group(list(range(tp_rank, world, tp)))
            if rank % tp == tp_rank:
                self._dp_group = group

    def initialize(self, addr: str | None = None, ft_spec: Any = None, **kwargs: Any) -> None:
        Path(self.config.record_dir).mkdir(parents=True, exist_ok=True)
        self.initialized = True

    def destroy(self) -> None:
        self.initialized = False
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        return self._dp_group

    @property
    def data_parallel_rank(self) -> int:
        return dist.get_rank() // self.config.tp_size

    @property
    def data_parallel_world_size(self) -> int:
        return dist.get_world_size() // self.config.tp_size

    @property
    def context_and_model_parallel_group(self) -> dist.ProcessGroup:
        return self._tp_group

    def current_data_parallel_head(self) -> int:
        return min(dist.get_process_group_ranks(self._tp_group))

    # --- recording ---

    def _record(self, method: str, data: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Save the call's arguments, then check the TP group holds the same data."""
        call = self._calls.get(method, 0)
        self._calls[method] = call + 1
        rank = dist.get_rank()
        path = Path(self.config.record_dir) / f"{method}-{call}-rank{rank}.pt"
        torch.save({"data": data, "kwargs": kwargs, "dp_rank": self.data_parallel_rank}, path)
        # a position-weighted checksum of the token ids: equal on every TP rank or raise
        ids = data["input_ids"].double()
        weights = torch.arange(1, ids.numel() + 1, dtype=torch.float64).reshape(ids.shape)
        digest = torch.tensor([float(ids.numel()), float((ids * weights).sum())])
        gathered = [torch.zeros_like(digest) for _ in range(self.config.tp_size)]
        dist.all_gather(gathered, digest, group=self._tp_group)
        if any(not torch.equal(g, digest) for g in gathered):
            raise RuntimeError(f"rank {rank}: TP ranks got different {method} data: {gathered}")

    # --- the actor's data methods ---

    def compute_logp(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[B, L]``: the share's token ids plus :data:`LOGP_OFFSET`."""
        self._record("compute_logp", data)
        return data["input_ids"].float() + LOGP_OFFSET

    def compute_advantages(
        self, data: dict[str, torch.Tensor], group_sizes: list[int] | None = None
    ) -> dict[str, torch.Tensor]:
        """``advantages [B, L]`` = 2 x token ids; ``n_tokens [B]`` = each row's length."""
        self._record("compute_advantages", data, group_sizes=group_sizes)
        return {
            "advantages": 2.0 * data["input_ids"].float(),
            "n_tokens": data["attention_mask"].sum(1),
        }

    def ppo_update(self, data: dict[str, torch.Tensor]) -> list[dict[str, float]]:
        """:data:`N_MINIBATCHES` stats dicts with the global token count (all-reduced)."""
        self._record("ppo_update", data)
        tokens = data["attention_mask"].sum().double().reshape(1)
        dist.all_reduce(tokens, group=self._dp_group)
        return [
            {"step": float(k), "global_tokens": float(tokens), "dp_rank": self.data_parallel_rank}
            for k in range(N_MINIBATCHES)
        ]

    def export_stats(self) -> dict[str, float]:
        """Which rank answered (a barrier first: the real engines reduce here)."""
        dist.barrier()
        return {"rank": float(dist.get_rank()), "dp_rank": float(self.data_parallel_rank)}

    # --- the rest of the interface ---

    def train(self, mode: bool = True) -> RecordingMPEngine:
        return self

    def connect_engine(self, rollout_engine: Any, meta: Any) -> None:
        pass

    def update_weights(self, meta: Any) -> None:
        pass

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return self._version

    def save(self, meta: Any) -> None:
        pass

    def load(self, meta: Any) -> None:
        pass

    def optimizer_zero_grad(self) -> None:
        pass

    def optimizer_step(self) -> dict[str, float]:
        return {}

    def lr_scheduler_step(self) -> None:
        pass

    def train_batch(self, input_: dict[str, Any], loss_fn: Any, loss_weight_fn: Any) -> dict:
        return {}

    def eval_batch(self, input_: dict[str, Any], loss_fn: Any, loss_weight_fn: Any) -> Any:
        return None

    def forward_batch(self, input_: dict[str, Any], **kwargs: Any) -> Any:
        return None
