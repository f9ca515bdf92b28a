"""Optimizers and learning-rate schedules from an :class:`OptimizerConfig`.

Schedules warm up linearly from 0 to the peak ``lr`` over the warmup steps
(``warmup_steps``, else ``warmup_steps_proportion`` of the total), then hold it
(``constant``), or decay it linearly or along a half cosine to ``min_lr_ratio * lr`` at
the last step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from areal.api.cli_args import OptimizerConfig

__all__ = ["build_lr_scheduler", "build_optimizer", "lr_multiplier"]


def build_optimizer(
    params: Iterable[torch.nn.Parameter], config: OptimizerConfig, device_type: str
) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if config.type == "adam":
        return torch.optim.AdamW(
            params,
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
            weight_decay=config.weight_decay,
            fused=device_type == "cuda",
        )
    if config.type == "sgd":
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    raise ValueError(
        f"optimizer.type {config.type!r} is not supported by this engine (bf16 optimizer "
        "states are not implemented); use adam or sgd"
    )


def lr_multiplier(step: int, config: OptimizerConfig, total_steps: int) -> float:
    """The factor applied to the peak learning rate at optimizer step ``step`` (0-based)."""
    warm = config.num_warmup_steps(total_steps)
    if step < warm:
        return (step + 1) / (warm + 1)
    kind = config.lr_scheduler_type
    if kind == "constant":
        return 1.0
    span = max(1, total_steps - warm)
    progress = min(1.0, (step - warm) / span)
    floor = config.min_lr_ratio
    if kind == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    if kind == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(
        f"actor.optimizer.lr_scheduler_type {kind!r} is not supported; "
        "use constant, linear or cosine"
    )


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimizerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    total = max(1, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, config, total)
    )
