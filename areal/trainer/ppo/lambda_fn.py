"""Per-trajectory GAE λ: built-in λ functions and the resolver for ``actor.gae_lambda``.

``actor.gae_lambda`` is either a number (one λ for every row) or the dotted path of a
function ``fn(context: GAELambdaContext, **actor.gae_lambda_kwargs) -> Tensor[rows]``.
The context is computed from the *shifted* loss mask ``M`` and turn ids ``u'`` (step 4 of
docs/grpo.md#advantage-pipeline), so lengths count trainable positions, not prompt tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from areal.utils.dynamic_import import import_from_string

__all__ = [
    "GAELambdaContext",
    "TimestepUnit",
    "build_lambda_context",
    "constant_gae_lambda",
    "gae_lambda_values",
    "relative_position_gae_lambda",
    "vapo_length_adaptive_gae",
]

TimestepUnit = Literal["token", "turn"]


@dataclass(frozen=True)
class GAELambdaContext:
    """Per-row lengths a λ function may depend on; every tensor is ``[rows]`` int64."""

    effective_token_lengths: torch.Tensor
    """Trainable positions of the row (``Σ_t M_t``)."""
    turn_counts: torch.Tensor
    """Distinct turn ids among the trainable positions (zeros without turn ids)."""
    timestep_lengths: torch.Tensor
    """GAE time steps: ``effective_token_lengths`` in token mode, ``turn_counts`` in turn mode."""

    @property
    def rows(self) -> int:
        return self.timestep_lengths.shape[0]

    @property
    def device(self) -> torch.device:
        return self.timestep_lengths.device


def constant_gae_lambda(context: GAELambdaContext, value: float = 1.0) -> torch.Tensor:
    """The same λ = ``value`` for every row."""
    return torch.full((context.rows,), float(value), dtype=torch.float32, device=context.device)


def vapo_length_adaptive_gae(context: GAELambdaContext, alpha: float) -> torch.Tensor:
    """Length-adaptive λ = ``max(0, 1 − 1/(alpha · L))`` over ``L`` time steps (0 when L = 0).

    Longer trajectories get λ closer to 1, so the outcome reward is not discounted away.
    """
    if not alpha > 0:
        raise ValueError(f"vapo_length_adaptive_gae needs alpha > 0 (got {alpha})")
    steps = context.timestep_lengths.to(torch.float64)
    lam = (1.0 - 1.0 / (alpha * steps.clamp_min(1.0))).clamp_min(0.0)
    return torch.where(steps > 0, lam, 0.0).to(torch.float32)


def relative_position_gae_lambda(context: GAELambdaContext, q: float) -> torch.Tensor:
    """λ = ``q^(1/(L−1))`` so the first of ``L`` steps keeps a weight ``q`` of the last one.

    ``L = 1`` gives 1 and ``L = 0`` gives 0. Needs ``0 < q ≤ 1``.
    """
    if not 0 < q <= 1:
        raise ValueError(f"relative_position_gae_lambda needs 0 < q <= 1 (got {q})")
    steps = context.timestep_lengths.to(torch.float64)
    lam = torch.pow(torch.full_like(steps, float(q)), 1.0 / (steps - 1.0).clamp_min(1.0))
    lam = torch.where(steps >= 2, lam, torch.where(steps == 1, 1.0, 0.0))
    return lam.to(torch.float32)


def build_lambda_context(
    loss_mask: torch.Tensor, turn_ids: torch.Tensor | None, timestep_unit: TimestepUnit
) -> GAELambdaContext:
    """The λ context of a padded batch from the shifted mask and turn ids (both ``[B, L]``)."""
    trainable = loss_mask.bool()
    token_lengths = trainable.sum(-1)
    if turn_ids is None:
        turn_counts = torch.zeros_like(token_lengths)
    else:
        turn_counts = _distinct_turns(turn_ids, trainable)
    steps = turn_counts if timestep_unit == "turn" else token_lengths
    return GAELambdaContext(token_lengths, turn_counts, steps)


def _distinct_turns(turn_ids: torch.Tensor, trainable: torch.Tensor) -> torch.Tensor:
    """Per row, the number of distinct ``turn_ids`` among ``trainable`` positions."""
    sentinel = torch.iinfo(torch.int64).max
    keys = torch.where(trainable, turn_ids.long(), sentinel).sort(-1).values
    first = torch.ones_like(keys[:, :1], dtype=torch.bool)
    changed = torch.cat([first, keys[:, 1:] != keys[:, :-1]], dim=-1)
    return (changed & (keys != sentinel)).sum(-1)


def gae_lambda_values(
    gae_lambda: float | str,
    gae_lambda_kwargs: Mapping[str, Any] | None,
    loss_mask: torch.Tensor,
    turn_ids: torch.Tensor | None,
    timestep_unit: TimestepUnit,
) -> float | torch.Tensor:
    """λ for GAE: the number itself, or the ``[B]`` float tensor of the named λ function.

    ``loss_mask`` and ``turn_ids`` are the shifted ``[B, L]`` tensors. The function's result is
    checked (a floating tensor of shape ``[B]`` on the mask's device, all finite).
    """
    if isinstance(gae_lambda, (int, float)) and not isinstance(gae_lambda, bool):
        return float(gae_lambda)
    if not isinstance(gae_lambda, str):
        raise TypeError(f"gae_lambda must be a number or a dotted path (got {gae_lambda!r})")
    fn = import_from_string(gae_lambda)
    if not callable(fn):
        raise TypeError(f"gae_lambda {gae_lambda!r} does not name a function")
    context = build_lambda_context(loss_mask, turn_ids, timestep_unit)
    lam = fn(context, **dict(gae_lambda_kwargs or {}))
    _check_lambda(lam, context, gae_lambda)
    return lam


def _check_lambda(lam: Any, context: GAELambdaContext, name: str) -> None:
    if not isinstance(lam, torch.Tensor):
        raise TypeError(f"λ function {name!r} returned {type(lam).__name__}, not a tensor")
    if not lam.is_floating_point():
        raise TypeError(f"λ function {name!r} returned dtype {lam.dtype}; a float is needed")
    if tuple(lam.shape) != (context.rows,):
        raise ValueError(
            f"λ function {name!r} returned shape {tuple(lam.shape)}; expected ({context.rows},)"
        )
    if lam.device != context.device:
        raise ValueError(
            f"λ function {name!r} returned a tensor on {lam.device}, not {context.device}"
        )
    if not torch.isfinite(lam).all():
        raise ValueError(f"λ function {name!r} returned non-finite values: {lam.tolist()}")
