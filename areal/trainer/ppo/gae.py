"""Generalized advantage estimation over padded rows (docs/grpo.md#advantage-pipeline,
step 8), without a time loop.

Token level: steps are the trainable positions of a row; turn level: steps are the turns
(rewards summed per turn). A masked position keeps the carry of the next trainable one.
The backward recursion ``a_t = δ_t + γλ a_{t+1}`` over valid steps is evaluated as
``a_t = Σ_{s ≥ t} (γλ)^{K_t - K_s} δ_s`` (``K_t`` = valid steps in ``[t, T)``) with a
reversed log-cumsum-exp in float64, so rows of tens of thousands of tokens cost a few
vectorized passes.
"""

from __future__ import annotations

import torch

__all__ = ["gae_token_level", "gae_turn_level"]

# decay = γλ = 0 becomes this in log space: decay^k underflows to 0 for any k ≥ 1.
_TINY_DECAY = 1e-300


def _row_decay(gamma: float, lam: float | torch.Tensor, rows: int, device) -> torch.Tensor:
    """``γλ`` as a float64 ``[rows, 1]`` column."""
    lam = torch.as_tensor(lam, dtype=torch.float64, device=device)
    if lam.dim() > 0 and tuple(lam.shape) != (rows,):
        raise ValueError(f"per-row λ must have shape ({rows},), got {tuple(lam.shape)}")
    decay = (gamma * lam).expand(rows).reshape(rows, 1)
    if bool((decay < 0).any()):
        raise ValueError(f"discount·λ must be >= 0 (γ={gamma}, λ={lam.tolist()})")
    return decay


def _discounted_suffix_sum(
    d: torch.Tensor, valid: torch.Tensor, decay: torch.Tensor
) -> torch.Tensor:
    """``a_t = Σ_{s ≥ t} decay^(K_t − K_s) · d_s`` with ``K_t`` = valid steps in ``[t, T)``.

    This is the backward recursion ``a_t = d_t + decay·a_{t+1}`` on valid steps and
    ``a_t = a_{t+1}`` on the others, without a loop: positive and negative parts of ``d``
    are summed with a reversed ``logcumsumexp``, so no ``decay^(−K)`` ever overflows.
    ``d [B, T]`` float64 (zero where not valid), ``decay [B, 1]``.
    """
    k = valid.flip(-1).cumsum(-1).flip(-1).double()
    log_decay = decay.clamp_min(_TINY_DECAY).log()

    def log_suffix(part: torch.Tensor) -> torch.Tensor:
        logs = torch.where(
            part > 0, torch.where(part > 0, part, 1.0).log() - k * log_decay, -torch.inf
        )
        return logs.flip(-1).logcumsumexp(-1).flip(-1)

    scale = k * log_decay
    return (scale + log_suffix(d)).exp() - (scale + log_suffix(-d)).exp()


def _gae_skipping_invalid(
    rewards: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    bootstrap: torch.Tensor,
    gamma: float,
    decay: torch.Tensor,
) -> torch.Tensor:
    """Backward GAE along the last dim where invalid steps keep the carry.

    For a valid step ``t`` whose next valid step is ``t'`` (``V_{t'}`` = ``bootstrap`` past the
    end): ``δ_t = r_t + γ·V_{t'} − V_t`` and ``A_t = δ_t + γλ·A_{t'}``; an invalid step takes
    ``A`` of the next valid step (0 if none). All tensors ``[B, T]`` float64, ``bootstrap [B]``.
    """
    rows, steps = rewards.shape
    position = torch.arange(steps, device=rewards.device).expand(rows, steps)
    next_valid = torch.where(valid, position, steps).flip(-1).cummin(-1).values.flip(-1)
    after = torch.cat([next_valid[:, 1:], next_valid.new_full((rows, 1), steps)], dim=-1)
    v_next = torch.cat([values, bootstrap[:, None]], dim=-1).gather(1, after)
    delta = torch.where(valid, rewards + gamma * v_next - values, 0.0)
    return _discounted_suffix_sum(delta, valid, decay)


def gae_token_level(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    seq_lens: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE over shifted ``[B, L]`` tensors; returns ``(advantages, returns)``.

    ``mask`` is ``M`` (trainable positions), ``seq_lens [B]`` the real lengths ``n``, ``lam``
    a float or a ``[B]`` tensor. ``A_{L−1} = 0``; a masked position keeps the advantage of the
    next trainable one (and its reward is discarded); ``V`` past the end is ``V_{L−1}`` only
    for rows that fill the width. Outputs are float32.
    """
    rows, width = rewards.shape
    v = values.double()
    valid = mask.bool().clone()
    valid[:, -1] = False  # the recursion starts at L−2: the last column never updates
    bootstrap = v[:, -1] * (seq_lens == width)
    decay = _row_decay(gamma, lam, rows, rewards.device)
    adv = _gae_skipping_invalid(rewards.double(), v, valid, bootstrap, gamma, decay)
    return adv.float(), (adv + v).float()


def gae_turn_level(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    turn_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level GAE over shifted ``[B, L]`` tensors; returns ``(advantages, returns)``.

    A turn's reward is the sum of its trainable positions' rewards and its value is ``V`` at
    its first trainable position; turns without trainable positions are skipped. Each
    trainable position gets its turn's advantage (0 at masked positions). ``turn_ids`` (the
    shifted ``u'``) must lie in ``[0, L)`` and not decrease along the trainable positions of
    a row. The caller adds the KL rewards afterwards. Outputs are float32.
    """
    rows, width = rewards.shape
    trainable = mask.bool()
    turn = turn_ids.long()
    _check_turn_ids(turn, trainable, width)
    turn = torch.where(trainable, turn, 0)  # index into a per-row table of `width` turns
    v = values.double()
    turn_reward = torch.zeros_like(v).scatter_add_(
        1, turn, torch.where(trainable, rewards, 0.0).double()
    )
    has_tokens = torch.zeros_like(turn).scatter_add_(1, turn, trainable.long()) > 0
    position = torch.where(trainable, torch.arange(width, device=v.device), width)
    first = torch.full_like(turn, width).scatter_reduce_(1, turn, position, "amin")
    turn_value = torch.cat([v, v.new_zeros(rows, 1)], dim=-1).gather(1, first)
    bootstrap = v[:, -1] * (seq_lens == width)
    decay = _row_decay(gamma, lam, rows, rewards.device)
    turn_adv = _gae_skipping_invalid(turn_reward, turn_value, has_tokens, bootstrap, gamma, decay)
    m = trainable.double()
    adv = turn_adv.gather(1, turn) * m
    returns = (turn_adv + turn_value).gather(1, turn) * m + v * (1.0 - m)
    return adv.float(), returns.float()


def _check_turn_ids(turn: torch.Tensor, trainable: torch.Tensor, width: int) -> None:
    out_of_range = trainable & ((turn < 0) | (turn >= width))
    if bool(out_of_range.any()):
        bad = turn[out_of_range].unique().tolist()
        raise ValueError(f"turn ids of trainable positions must lie in [0, {width}); got {bad}")
    running_max = torch.where(trainable, turn, -1).cummax(-1).values
    if bool((trainable & (turn < running_max)).any()):
        raise ValueError("turn ids must not decrease along the trainable positions of a row")
