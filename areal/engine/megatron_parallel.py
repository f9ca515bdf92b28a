"""The Megatron engine's process groups, and reductions over its ranks.

Megatron-Core's tensor / pipeline / context / expert / data groups come from the
allocation string (``megatron:d2t2p1``, or ``megatron:(attn:...|ffn:...)`` for MoE), in
Megatron's ``tp-cp-ep-dp-pp`` order, plus a gloo group over every rank. One rank per
data-parallel replica (TP rank 0, CP rank 0, last pipeline stage) reports loss and
statistics: the others hold copies (every CP rank computes the same loss on the gathered
micro-batch) or nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from areal.engine.train_common import PROCESS_GROUP_TIMEOUT, init_default_process_group

__all__ = ["MegatronParallelGroups"]


class MegatronParallelGroups:
    """Mixin: ``create_process_group``, the rank queries of ``TrainEngine``, and the
    reductions the engine needs (global loss weight, reported sums, statistics).

    Reads ``config`` (``backend``, ``megatron.virtual_pipeline_parallel_size``); sets
    ``device``, ``parallel``, ``_own_process_group`` and the groups below.
    """

    config: Any
    device: torch.device
    parallel: Any
    _own_process_group: bool
    _groups_ready: bool
    _cpu_group: dist.ProcessGroup | None
    _mp_group: dist.ProcessGroup | None
    _reporter_group: dist.ProcessGroup | None
    _reporters: list[int]

    def _strategy(self, parallel_strategy: Any, world: int):
        from areal.api.alloc_mode import ModelAllocation, ParallelStrategy

        if parallel_strategy is None:
            backend = getattr(self.config, "backend", None)
            if isinstance(backend, str) and backend.startswith("megatron"):
                parallel_strategy = ModelAllocation.from_str(backend).parallel
            else:
                parallel_strategy = ParallelStrategy(data_parallel_size=world)
        if parallel_strategy.world_size != world:
            raise ValueError(
                f"the allocation spans {parallel_strategy.world_size} ranks "
                f"(d{parallel_strategy.dp_size} t{parallel_strategy.tp_size} "
                f"p{parallel_strategy.pp_size} c{parallel_strategy.cp_size}) but "
                f"torch.distributed has {world}"
            )
        return parallel_strategy

    def create_process_group(self, parallel_strategy: Any = None) -> None:
        from megatron.core import parallel_state, tensor_parallel

        device, created = init_default_process_group()
        if device is not None:
            self.device = device
        self._own_process_group = self._own_process_group or created
        p = self.parallel = self._strategy(parallel_strategy, dist.get_world_size())
        vpp = self.config.megatron.virtual_pipeline_parallel_size
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tp_size,
            pipeline_model_parallel_size=p.pp_size,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            context_parallel_size=p.cp_size,
            expert_model_parallel_size=p.ep_size,
            expert_tensor_parallel_size=p.etp_size,
            order="tp-cp-ep-dp-pp",
        )
        if device is not None:
            tensor_parallel.model_parallel_cuda_manual_seed(1)
        self._cpu_group = (
            dist.new_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)
            if dist.get_backend() != "gloo"
            else dist.group.WORLD
        )
        self._mp_group = (
            parallel_state.get_model_parallel_group()
            if p.cp_size == 1
            else self._replica_group(parallel_state.get_data_parallel_rank())
        )
        # ranks whose loss and statistics count: one per data-parallel replica (the CP ranks
        # of a replica record the same statistics of the same micro-batches)
        reporter = (
            parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0
            and parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        )
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, reporter, group=self._cpu_group)
        self._reporters = [r for r, flag in enumerate(flags) if flag]
        self._reporter_group = dist.new_group(
            self._reporters, backend="gloo", timeout=PROCESS_GROUP_TIMEOUT
        )
        self._groups_ready = True

    def _replica_group(self, dp_rank: int) -> dist.ProcessGroup:
        """The ranks of this data-parallel replica (tensor x context x pipeline): Megatron's
        model-parallel group leaves out the context-parallel ranks, which take the same data."""
        ranks_of = [None] * dist.get_world_size()
        dist.all_gather_object(ranks_of, dp_rank, group=self._cpu_group)
        mine = None
        for replica in sorted(set(ranks_of)):  # every rank creates every group, in order
            members = [r for r, d in enumerate(ranks_of) if d == replica]
            group = dist.new_group(members, timeout=PROCESS_GROUP_TIMEOUT)
            if replica == dp_rank:
                mine = group
        return mine

    def _destroy_process_groups(self) -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        self._groups_ready = False
        if self._own_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_process_group = False

    # --- rank queries ---

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    @property
    def data_parallel_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def data_parallel_world_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    @property
    def cpu_group(self) -> dist.ProcessGroup:
        return self._cpu_group

    @property
    def context_and_model_parallel_group(self) -> dist.ProcessGroup:
        return self._mp_group

    def current_data_parallel_head(self) -> int:
        return min(dist.get_process_group_ranks(self._mp_group))

    @property
    def _tp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    @property
    def _is_last_stage(self) -> bool:
        from megatron.core import parallel_state

        return parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    # --- reductions over ranks ---

    def _broadcast_from_last_stage(self, tensor: torch.Tensor | None, shape, dtype):
        """``tensor`` from the last pipeline stage on every stage (``shape``/``dtype`` tell
        the other stages what to receive)."""
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        tensor = tensor.to(self.device)
        dist.broadcast(
            tensor,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return tensor

    def _global_weight(self, weights: list[float]) -> float:
        # every rank of a model-parallel group holds the same data: sum over all, divide
        total = torch.tensor([sum(weights)], dtype=torch.float64)
        dist.all_reduce(total, group=self._cpu_group)
        return float(total.item()) * self.data_parallel_world_size / dist.get_world_size()

    def _reported_sum(self, value: float) -> float:
        """Sum of ``value`` over the reporting ranks (one per DP replica), on every rank."""
        mine = value if dist.get_rank() in self._reporters else 0.0
        total = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(total, group=self._cpu_group)
        return float(total.item())

    def export_stats(self) -> dict[str, float]:
        """Statistics reduced over the data-parallel replicas, the same on every rank.

        Loss statistics exist only on the last pipeline stage and repeat on every TP rank,
        so one rank per replica reduces them and the result is broadcast.
        """
        from areal.utils import stats_tracker

        if dist.get_rank() in self._reporters:
            stats = stats_tracker.export_all(reduce_group=self._reporter_group)
        else:
            stats_tracker.export_all()  # drop the duplicates
            stats = None
        box = [stats]
        dist.broadcast_object_list(box, src=self._reporters[0], group=self._cpu_group)
        return box[0]
