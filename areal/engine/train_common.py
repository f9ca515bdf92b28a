"""What the FSDP and Megatron train engines share: dtypes, the default process group, the
loss-function types, and helpers for padded and packed batches (and their layout under
context parallelism)."""

from __future__ import annotations

import datetime
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from areal.engine.context_parallel import (
    ContextShard,
    gather_tokens,
    padded_length,
    plan_shard,
)
from areal.utils.network import find_free_port

__all__ = [
    "DTYPES",
    "PROCESS_GROUP_TIMEOUT",
    "ContextParallelStream",
    "LossFn",
    "WeightFn",
    "context_parallel_stream",
    "flat_micro_batch",
    "init_default_process_group",
    "mask_last_tokens",
    "to_dtype",
]

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=7200)

LossFn = Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]
WeightFn = Callable[[dict[str, Any]], float | torch.Tensor]


def to_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}") from None


def init_default_process_group() -> tuple[torch.device | None, bool]:
    """Select this rank's GPU (``LOCAL_RANK``) and start the default process group.

    NCCL with a GPU, gloo without; from ``RANK``/``MASTER_ADDR`` when a launcher set them,
    else a private one-rank group. Returns ``(cuda device or None, whether this call
    created the group)``.
    """
    from areal.platforms import detect_platform

    platform = detect_platform()
    device = None
    if platform.device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        platform.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if dist.is_initialized():
        return device, False
    backend = platform.communication_backend
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=PROCESS_GROUP_TIMEOUT)
    else:  # a single process: a private one-rank group
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{find_free_port('127.0.0.1')}",
            rank=0,
            world_size=1,
            timeout=PROCESS_GROUP_TIMEOUT,
        )
    return device, True


def mask_last_tokens(logp: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``logp [B, L]`` with 0 wherever no next real token exists (padding, last real token)."""
    has_next = torch.zeros_like(logp, dtype=torch.bool)
    has_next[:, :-1] = attention_mask[:, 1:].to(logp.device)
    return logp * has_next


def flat_micro_batch(mb: dict[str, Any]) -> dict[str, Any]:
    """The micro-batch with per-token ``[1, T]`` tensors flattened to ``[T]``."""
    return {
        k: v[0] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == 1 else v
        for k, v in mb.items()
    }


# --- a packed micro-batch under context parallelism ---


@dataclass(frozen=True, eq=False)
class ContextParallelStream:
    """One rank's share of a packed micro-batch, and the way back to the micro-batch's stream.

    The CP stream holds the micro-batch's real sequences, each padded at its end to a
    multiple of ``2c`` tokens (:func:`~areal.engine.context_parallel.padded_length`), then
    (for sequence parallelism) a padding segment that makes every rank's share a multiple
    of ``multiple`` tokens; the micro-batch's own padding tail is dropped.
    ``input_ids``/``position_ids`` ``[1, T / c]`` and ``labels`` ``[T / c]``: this rank's
    tokens, their positions inside their sequences and their next-token labels (taken from
    the unsharded stream, so no label crosses ranks). ``stream_index`` ``[T_mb]``: for each
    token of the micro-batch's stream, its index in the CP stream, or ``T`` (one past the
    end) for the padding tail.
    """

    shard: ContextShard
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    stream_index: torch.Tensor

    def to_stream(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, ...]`` in CP-stream order -> ``[T_mb, ...]`` in the micro-batch's
        stream order, zeros on its padding tail (differentiable)."""
        padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
        return padded.index_select(0, self.stream_index.to(x.device))

    def gather(
        self, logp: torch.Tensor, entropy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's ``logp`` and ``entropy`` ``[T / c]`` -> ``[T_mb]`` each, in the
        micro-batch's stream order: what the loss function gets at ``c = 1`` (zeros on the
        padding tail). ``logp`` stays differentiable: the gather's backward sums the CP
        group's gradients of each rank's tokens; ``entropy`` comes back detached."""
        both = gather_tokens(torch.stack([logp, entropy.to(logp.dtype)], dim=-1), self.shard)
        logp, entropy = self.to_stream(both).unbind(-1)
        return logp, entropy.detach()


def context_parallel_stream(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    n_rows: int,
    labels: torch.Tensor,
    size: int,
    rank: int,
    group: dist.ProcessGroup | None,
    multiple: int = 1,
) -> ContextParallelStream:
    """Lay out a packed micro-batch for rank ``rank`` of a context-parallel group of ``size``.

    ``input_ids`` ``[T_mb]`` and ``labels`` ``[T_mb]`` in the micro-batch's stream order,
    ``cu_seqlens`` ``[n + 1]`` its bounds, of which the first ``n_rows`` are real sequences
    (a trailing segment is padding). ``multiple``: every rank's share is padded to a multiple
    of it (Megatron's sequence parallelism splits a share evenly over the TP ranks).
    """
    device = input_ids.device
    bounds = [int(b) for b in cu_seqlens[: n_rows + 1].tolist()]
    lengths = [e - s for s, e in itertools.pairwise(bounds)]
    padded = [padded_length(n, size) for n in lengths]
    step = math.lcm(2 * size, size * multiple)  # sum(padded) is already a multiple of 2c
    extra = -sum(padded) % step
    cp_starts = [0, *itertools.accumulate(padded + ([extra] if extra else []))]
    n_tokens = cp_starts[-1]
    # each real token's place in the CP stream; the padding tail points one past the end
    stream_index = torch.full((input_ids.shape[0],), n_tokens, dtype=torch.long)
    for start, cp_start, n in zip(bounds, cp_starts, lengths, strict=False):
        stream_index[start : start + n] = torch.arange(cp_start, cp_start + n)
    stream_index = stream_index.to(device)
    real = stream_index < n_tokens
    ids = input_ids.new_zeros(n_tokens).index_copy_(0, stream_index[real], input_ids[real])
    cp_labels = labels.new_zeros(n_tokens).index_copy_(0, stream_index[real], labels[real])
    shard = plan_shard(torch.tensor(cp_starts), size, rank, group=group, device=device)
    return ContextParallelStream(
        shard=shard,
        input_ids=shard.shard(ids)[None],
        position_ids=shard.positions[None],
        labels=shard.shard(cp_labels),
        stream_index=stream_index,
    )
