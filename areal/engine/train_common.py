"""What the FSDP and Megatron train engines share: dtypes, the default process group, the
loss-function types, and helpers for padded and packed batches."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from areal.utils.network import find_free_port

__all__ = [
    "DTYPES",
    "PROCESS_GROUP_TIMEOUT",
    "LossFn",
    "WeightFn",
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
