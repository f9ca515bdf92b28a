"""PPO/GRPO maths as pure tensor functions: rewards → advantages → the clipped loss.

Why the pipeline looks like this: GRPO has no critic, so ``V ≡ 0``; with ``γ = λ = 1`` GAE
hands every trainable token of a row the row's group-normalized outcome reward, which is
GRPO's sequence-level advantage broadcast to tokens. The loss of one micro-batch is
``Σ L_t / N_mb`` and the engine rescales it by ``N_mb / W``, so an optimizer step minimizes
the mean over all trainable tokens of the global minibatch (a token mean, not a mean of
per-sequence means).

Shapes: a *padded* batch is ``[B, L]`` (rows right-padded); a *packed* micro-batch is one
token stream ``[T]`` (or ``[1, T]``) whose rows are delimited by ``cu_seqlens [R + 1]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from areal.api.cli_args import NormConfig, PPOActorConfig, RejectionSamplingConfig
from areal.trainer.ppo.gae import gae_token_level, gae_turn_level
from areal.trainer.ppo.lambda_fn import gae_lambda_values

__all__ = [
    "KLEstimator",
    "Normalizer",
    "ProxLogpMethod",
    "compute_advantages",
    "gae_token_level",
    "gae_turn_level",
    "kl_estimate",
    "kl_rewards",
    "normalize",
    "ppo_actor_loss",
    "prox_logp_for_method",
    "shape_rewards",
]

KLEstimator = Literal["k1", "k2", "k3"]
ProxLogpMethod = Literal["recompute", "metrics", "reuse_train_logp", "loglinear"]

KL_REWARD_CLAMP = 10.0


# --- rewards and normalization (docs/grpo.md: pipeline steps 2-3, #normalization) ----------


def shape_rewards(rewards: torch.Tensor, bias: float, scaling: float, clip: float) -> torch.Tensor:
    """``clip((r + bias) · scaling, −clip, +clip)`` per row (``rewards [B]``)."""
    return ((rewards + bias) * scaling).clamp(-clip, clip)


@dataclass(frozen=True)
class _Segments:
    """Rows grouped into consecutive slices; statistics are summed per slice."""

    row_ids: torch.Tensor  # [B] slice of each row
    one_row: torch.Tensor  # [S] slice holds exactly one row
    usable: torch.Tensor  # [S] False for a trailing remainder of fixed-size chunks

    @property
    def count(self) -> int:
        return self.one_row.shape[0]

    def of_elements(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
        return self.row_ids.view(shape).expand_as(x)

    def sum(self, values: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(self.count)
        return out.index_add_(0, seg.reshape(-1), values.reshape(-1))


def _segments(
    level: str, n_rows: int, group_sizes: list[int] | None, group_size: int, device: torch.device
) -> _Segments:
    if level == "batch":
        sizes, usable = [n_rows], [True]
    elif group_sizes is not None:
        if any(g <= 0 for g in group_sizes) or sum(group_sizes) != n_rows:
            raise ValueError(f"group_sizes {group_sizes} must be positive and sum to {n_rows}")
        sizes, usable = list(group_sizes), [True] * len(group_sizes)
    else:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1 (got {group_size})")
        n_full, rest = divmod(n_rows, group_size)
        sizes, usable = [group_size] * n_full, [True] * n_full
        if rest:  # the remainder is left with μ = 0 and σ = 0
            sizes, usable = [*sizes, rest], [*usable, False]
    counts = torch.tensor(sizes, device=device)
    return _Segments(
        row_ids=torch.repeat_interleave(torch.arange(len(sizes), device=device), counts),
        one_row=(counts == 1) & (level == "group"),
        usable=torch.tensor(usable, device=device),
    )


def _all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over ``group``; a CPU tensor visits the GPU when the group is NCCL-only."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return t
    if dist.get_backend(group) == "nccl" and t.device.type != "cuda":
        on_gpu = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM, group=group)
        t.copy_(on_gpu)
        return t
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _mean(
    x: torch.Tensor,
    sel: torch.Tensor,
    cfg: NormConfig,
    seg: _Segments,
    dp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Element-wise μ (float64, shape of ``x``) for ``cfg.mean_level``."""
    ids = seg.of_elements(x)
    stats = torch.stack([seg.sum(torch.where(sel, x, 0.0), ids), seg.sum(sel.double(), ids)])
    if cfg.mean_level == "batch":
        stats = _all_reduce_sum(stats, dp_group)
    total, count = stats[0], stats[1]
    plain = torch.where(count > 0, total / count.clamp_min(1.0), 0.0)
    mu = plain[ids]
    if cfg.mean_leave1out:
        others = (total[ids] - x) / (count[ids] - 1.0).clamp_min(1.0)
        mu = torch.where(sel, others, mu)
        mu = torch.where(count[ids] > 1, mu, 0.0)
        mu = torch.where(seg.one_row[ids], x, mu)
    return torch.where(seg.usable[ids], mu, 0.0)


def _std(
    x: torch.Tensor,
    mu: torch.Tensor,
    sel: torch.Tensor,
    cfg: NormConfig,
    seg: _Segments,
    dp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Element-wise σ (float64, shape of ``x``) for ``cfg.std_level``, centered on ``mu``."""
    ids = seg.of_elements(x)
    squares = torch.where(sel, (x - mu) ** 2, 0.0)
    stats = torch.stack([seg.sum(squares, ids), seg.sum(sel.double(), ids)])
    if cfg.std_level == "batch":
        stats = _all_reduce_sum(stats, dp_group)
    q, count = stats[0], stats[1]
    if cfg.std_unbiased:
        sigma = torch.where(count > 1, (q / (count - 1.0).clamp_min(1.0)).sqrt(), 1.0)
    else:
        sigma = torch.where(count > 0, (q / count.clamp_min(1.0)).sqrt(), 1.0)
    return torch.where(seg.usable, sigma, 0.0)[ids]


def normalize(
    x: torch.Tensor,
    config: NormConfig | None,
    mask: torch.Tensor | None = None,
    group_sizes: list[int] | None = None,
    group_size: int | None = None,
    dp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``(x − μ)·M / (σ + eps)``, computed in float64 and returned as float32
    (docs/grpo.md#normalization).

    ``x`` is ``[B]`` (rewards, no mask) or ``[B, L]`` (advantages, ``mask [B, L]``). Group
    slices are consecutive runs of ``group_sizes`` rows, else fixed chunks of ``group_size``
    (default ``config.group_size``). ``batch`` level sums counts and sums over ``dp_group``
    (the default group when None) once torch.distributed is initialized; ``group`` level
    never communicates. ``config=None`` and an all-zero ``mask`` return ``x`` unchanged.
    """
    if config is None:
        return x
    sel = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    x64 = x.double()
    size = config.group_size if group_size is None else group_size
    mu = torch.zeros_like(x64)
    if config.mean_level is not None:
        seg = _segments(config.mean_level, x.shape[0], group_sizes, size, x.device)
        mu = _mean(x64, sel, config, seg, dp_group)
    sigma, eps = torch.ones_like(x64), 0.0
    if config.std_level is not None:
        seg = _segments(config.std_level, x.shape[0], group_sizes, size, x.device)
        sigma, eps = _std(x64, mu, sel, config, seg, dp_group), config.eps
    # Checked after the collectives so that a rank without tokens still joins them.
    if mask is not None and not bool(sel.any()):
        return x
    centered = x64 - mu if mask is None else (x64 - mu) * sel.double()
    return (centered / (sigma + eps)).float()


@dataclass(frozen=True)
class Normalizer:
    """:func:`normalize` bound to one config (the actor keeps one for rewards, one for A)."""

    config: NormConfig | None

    def __call__(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        group_sizes: list[int] | None = None,
        group_size: int | None = None,
        dp_group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        return normalize(x, self.config, mask, group_sizes, group_size, dp_group)


# --- KL penalty (docs/grpo.md#advantage-pipeline, step 5) ---------------------------------


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLEstimator) -> torch.Tensor:
    """Per-token KL estimate from ``Δ = logp − ref_logp``: k1 ``Δ``, k2 ``Δ²/2``,
    k3 ``exp(−Δ) − 1 + Δ`` (unclamped)."""
    delta = logp - ref_logp
    if kind == "k1":
        return delta
    if kind == "k2":
        return delta.square() / 2
    if kind == "k3":
        return torch.expm1(-delta) + delta
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def kl_rewards(
    old_logp: torch.Tensor, ref_logp: torch.Tensor, kl_ctl: float, kind: KLEstimator
) -> torch.Tensor:
    """``−kl_ctl · clamp(KL̂(old, ref), −10, 10)``; masked inputs (both 0) give 0."""
    return -kl_ctl * kl_estimate(old_logp, ref_logp, kind).clamp(-KL_REWARD_CLAMP, KL_REWARD_CLAMP)


# --- the advantage pipeline (docs/grpo.md#advantage-pipeline) -----------------------------


def compute_advantages(
    batch: Mapping[str, torch.Tensor],
    cfg: PPOActorConfig,
    group_sizes: list[int] | None,
    dp_group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Rewards → per-token advantages for a padded batch (docs/grpo.md#advantage-pipeline).

    ``batch`` holds ``input_ids``, ``attention_mask`` (bool), ``loss_mask``, ``logprobs``,
    ``versions``, ``turn_ids`` (all ``[B, L]``), ``rewards [B]`` and optionally
    ``prox_logp``, ``ref_logp``, ``values`` ``[B, L]``. ``group_sizes`` are the rows per
    prompt, in order. Returns a new dict: the input keys plus ``advantages``, ``returns``,
    ``kl_rewards``, ``tot_rewards``, with ``loss_mask`` and ``logprobs`` shifted left by one
    (``logprobs`` masked), ``prox_logp``/``ref_logp`` aligned as in step 4. ``versions``,
    ``turn_ids``, ``attention_mask`` and ``rewards`` are passed through unchanged.
    """
    if cfg.overlong_reward_penalty:
        raise NotImplementedError(
            "actor.overlong_reward_penalty is not supported by this port; set it to false"
        )
    seq_lens = batch["attention_mask"].bool().sum(-1)
    width = batch["attention_mask"].shape[1]

    # --- outcome rewards: shaping, then normalization within each prompt's group ---
    rewards = shape_rewards(
        batch["rewards"].float(), cfg.reward_bias, cfg.reward_scaling, cfg.reward_clip
    )
    rewards = normalize(rewards, cfg.reward_norm, group_sizes=group_sizes, dp_group=dp_group)

    # --- alignment: from here on position t scores token t+1 ---
    loss_mask = torch.roll(batch["loss_mask"], -1, dims=-1)
    m = loss_mask.float()
    turn_ids = None
    if batch.get("turn_ids") is not None:
        turn_ids = torch.roll(batch["turn_ids"], -1, dims=-1)
        turn_ids[:, -1] = -1
    old_logp, prox_logp = _aligned_logprobs(batch, cfg, m)
    ref_logp = batch.get("ref_logp")
    if ref_logp is None and cfg.kl_ctl > 0:
        # scoring against 0 would turn the penalty -kl_ctl x logp into a per-token bonus
        raise ValueError(
            f"actor.kl_ctl is {cfg.kl_ctl} but the batch has no 'ref_logp' (reference "
            "log-probs); compute them with the ref model first, or set actor.kl_ctl: 0"
        )
    ref_logp = torch.zeros_like(old_logp) if ref_logp is None else ref_logp * m

    # --- per-position rewards: KL penalty and the outcome at the last scored token ---
    kl = kl_rewards(old_logp, ref_logp, cfg.kl_ctl, cfg.kl_estimator)
    last_token = (seq_lens - 1).clamp_min(0)[:, None]
    kl_hat = kl.scatter(1, last_token, 0.0)
    outcome = rewards
    if cfg.mask_no_eos_with_zero:  # a row that fills the width ended without EOS
        outcome = torch.where(seq_lens == width, 0.0, rewards)
    outcome_pos = (seq_lens - 2).clamp_min(0)[:, None]
    outcome = torch.zeros_like(kl).scatter(1, outcome_pos, outcome[:, None].to(kl.dtype))

    # --- GAE ---
    values = batch.get("values")
    values = torch.zeros_like(kl) if values is None else values.float()
    unit = cfg.gae_timestep_unit
    if unit == "turn" and turn_ids is None:
        raise ValueError("gae_timestep_unit 'turn' needs 'turn_ids' in the batch")
    lam = gae_lambda_values(cfg.gae_lambda, cfg.gae_lambda_kwargs, loss_mask, turn_ids, unit)
    if unit == "token":
        adv, returns = gae_token_level(
            kl_hat + outcome, values, loss_mask, seq_lens, cfg.discount, lam
        )
    else:
        adv, returns = gae_turn_level(
            outcome, values, loss_mask, turn_ids, seq_lens, cfg.discount, lam
        )
        adv = adv + kl_hat

    adv = normalize(adv, cfg.adv_norm, mask=loss_mask, group_sizes=group_sizes, dp_group=dp_group)

    out = dict(batch)
    out.update(
        advantages=adv,
        returns=returns,
        kl_rewards=kl,
        tot_rewards=kl_hat + outcome,
        loss_mask=loss_mask,
        logprobs=old_logp,
    )
    if prox_logp is not None:
        out["prox_logp"] = prox_logp
    if batch.get("ref_logp") is not None:
        out["ref_logp"] = ref_logp
    return out


def _aligned_logprobs(
    batch: Mapping[str, torch.Tensor], cfg: PPOActorConfig, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(ℓ^old, ℓ^prox)`` after the shift; ``ℓ^old`` is masked by ``m`` (step 4 of
    docs/grpo.md#advantage-pipeline).

    Without the decoupled loss the proximal policy *is* the old one: the same masked
    tensor. With it, a recomputed ``prox_logp`` is passed through unmasked.
    """
    if not cfg.use_decoupled_loss and cfg.recompute_logprob:
        if batch.get("prox_logp") is None:
            raise ValueError(
                "recompute_logprob without the decoupled loss needs the recomputed "
                "'prox_logp' in the batch"
            )
        old_logp = batch["prox_logp"] * m
        return old_logp, old_logp
    old_logp = torch.roll(batch["logprobs"], -1, dims=-1) * m
    if not cfg.use_decoupled_loss:
        return old_logp, old_logp
    return old_logp, batch.get("prox_logp")


# --- the actor loss (docs/grpo.md#actor-loss) ---------------------------------------------


def prox_logp_for_method(
    method: ProxLogpMethod,
    *,
    logprobs: torch.Tensor,
    old_logp: torch.Tensor,
    prox_logp: torch.Tensor | None = None,
    versions: torch.Tensor | None = None,
    current_version: int | None = None,
) -> torch.Tensor:
    """Proximal log-probs ``ℓ^prox`` for ``prox_logp_method``, gradient-free
    (docs/grpo.md#actor-loss, step 1).

    ``logprobs`` is the current ``ℓ^θ``, ``old_logp`` the behaviour ``ℓ^old`` (shifted),
    ``prox_logp`` the recomputed values (``recompute``/``metrics``; without the decoupled
    loss :func:`compute_advantages` already set it to ``ℓ^old``). ``loglinear`` interpolates
    ``ℓ^old + α·(ℓ^θ − ℓ^old)`` with ``α = clamp((v_θ − 1 − v)/(v_θ − v), 0, 1)`` from the
    token ``versions`` and the engine's ``current_version``; as in the reference, the
    versions are *not* shifted, so position ``t`` uses the version of token ``t``.
    Raises ValueError when a needed input is missing, RuntimeError on NaN/Inf.
    """
    if method in ("recompute", "metrics"):
        if prox_logp is None:
            raise ValueError(
                f"prox_logp_method {method!r} needs 'prox_logp' from compute_logp; none given"
            )
        prox = prox_logp.detach()
    elif method == "reuse_train_logp":
        prox = logprobs.detach()
    elif method == "loglinear":
        if versions is None or current_version is None:
            raise ValueError("prox_logp_method 'loglinear' needs versions and current_version")
        gap = current_version - versions.double()
        alpha = ((gap - 1.0) / gap.clamp_min(1.0)).clamp(0.0, 1.0)
        alpha = torch.where((gap > 0) & (versions >= 0), alpha, 0.0).to(old_logp.dtype)
        prox = old_logp + alpha * (logprobs.detach() - old_logp)
    else:
        raise ValueError(f"unknown prox_logp_method {method!r}")
    if not bool(torch.isfinite(prox).all()):
        raise RuntimeError(f"proximal log-probs from {method!r} contain NaN or Inf")
    return prox


@dataclass(frozen=True)
class _Rows:
    """The row of every token, for per-row sums over padded or packed tensors."""

    index: torch.Tensor  # shape of the tokens; packed padding past cu_seqlens[-1] is row R
    count: int

    @classmethod
    def of(cls, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None) -> _Rows:
        if cu_seqlens is not None:
            if tokens.dim() == 2 and tokens.shape[0] != 1:
                raise ValueError("cu_seqlens describes one packed stream: [T] or [1, T] inputs")
            position = torch.arange(tokens.shape[-1], device=tokens.device)
            bounds = cu_seqlens[1:].to(tokens.device)
            row = torch.searchsorted(bounds, position, right=True)
            return cls(row.expand_as(tokens), len(cu_seqlens))
        if tokens.dim() != 2:
            raise ValueError(
                "sequence-level terms need [B, L] inputs or cu_seqlens for packed ones"
            )
        row = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
        return cls(row.expand_as(tokens), tokens.shape[0])

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(self.count).index_add(0, self.index.reshape(-1), x.reshape(-1))

    def max(self, x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        x = torch.where(where, x, -torch.inf).reshape(-1)
        return x.new_full((self.count,), -torch.inf).scatter_reduce(
            0, self.index.reshape(-1), x, "amax"
        )

    def spread(self, per_row: torch.Tensor) -> torch.Tensor:
        return per_row[self.index]


def _behaviour_metric(metric: str, delta: torch.Tensor, raw_delta: torch.Tensor) -> torch.Tensor:
    """The rejection metric per token: ``exp(δ)`` from the cleaned ``δ`` (a non-finite
    difference weighs 1), KL estimators from the raw difference (non-finite is out of bounds)."""
    if metric == "ratio":
        return delta.exp()
    return kl_estimate(raw_delta, torch.zeros_like(raw_delta), metric.removeprefix("kl_"))


def _in_bounds(metric: torch.Tensor, cfg: RejectionSamplingConfig) -> torch.Tensor:
    ok = metric <= cfg.upper
    return ok if cfg.lower is None else ok & (metric >= cfg.lower)


def _rejection_sampling(
    delta: torch.Tensor,
    raw_delta: torch.Tensor,
    mask: torch.Tensor,
    cfg: RejectionSamplingConfig,
    rows: _Rows | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M', w)``: the kept mask and behaviour weights (docs/grpo.md#actor-loss, step 4).

    ``raw_delta`` is ``ℓ^prox − ℓ^old``; ``delta`` the same with non-finite entries set to 0.
    """
    weight = delta.exp()
    lower = 0.0 if cfg.lower is None else cfg.lower
    if cfg.level == "token":
        in_bounds = _in_bounds(_behaviour_metric(cfg.metric, delta, raw_delta), cfg)
        if cfg.action == "mask":
            kept = mask & in_bounds
        else:
            weight, kept = weight.clamp(lower, cfg.upper), mask
        return kept, torch.where(kept, weight, 0.0)

    assert rows is not None
    n_tokens = rows.sum(mask.float())
    if cfg.metric == "ratio":  # aggregated in log space; the token weight is the geometric mean
        log_sum = rows.sum(torch.where(mask, delta, 0.0))
        log_mean = log_sum / n_tokens.clamp_min(1.0)
        log_agg = {"sum": log_sum, "mean": log_mean, "max": rows.max(delta, mask)}[cfg.agg]
        row_metric = log_agg.exp()
        weight = rows.spread(log_mean.exp())
    else:
        token_metric = torch.where(mask, _behaviour_metric(cfg.metric, delta, raw_delta), 0.0)
        metric_sum = rows.sum(token_metric)
        row_metric = {
            "sum": metric_sum,
            "mean": metric_sum / n_tokens.clamp_min(1.0),
            "max": rows.max(token_metric, mask),
        }[cfg.agg]
    row_ok = rows.spread(_in_bounds(row_metric, cfg) | (n_tokens == 0))
    if cfg.action == "mask":
        kept = mask & row_ok
    else:
        weight, kept = torch.where(row_ok, weight, weight.clamp(lower, cfg.upper)), mask
    return kept, torch.where(kept, weight, 0.0)


def _sequence_ratio(
    log_ratio: torch.Tensor, advantages: torch.Tensor, kept: torch.Tensor, rows: _Rows
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: per row ``exp(mean_{M'} log ρ)`` and ``mean_{M'} A``, spread over ``M'``."""
    k = kept.to(log_ratio.dtype)
    count = rows.sum(k).clamp_min(1.0)
    seq_log_ratio = rows.sum(torch.where(kept, log_ratio, 0.0)) / count
    seq_adv = rows.sum(torch.where(kept, advantages, 0.0).to(log_ratio.dtype)) / count
    return rows.spread(seq_log_ratio.exp()) * k, rows.spread(seq_adv) * k


def ppo_actor_loss(
    logprobs: torch.Tensor,
    old_logp: torch.Tensor,
    prox_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection: RejectionSamplingConfig | None = None,
    importance_sampling_level: Literal["token", "sequence"] = "token",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled clipped PPO loss of one micro-batch (docs/grpo.md#actor-loss, steps 3-8).

    All token tensors share one shape: packed ``[T]``/``[1, T]`` with ``cu_seqlens [R+1]``,
    or padded ``[B, L]``. ``logprobs`` is ``ℓ^θ`` (with grad); ``old_logp``, ``prox_logp`` are
    treated as constants. Returns ``Σ_{M'} w_t·L_t / N_mb`` with ``N_mb = max(1, count(M))``
    counted *before* rejection sampling, and a stats dict:

    * masks (bool, token shape): ``loss_mask`` (``M``), ``kept_mask`` (``M'``, after
      rejection); per-token stats below are meant to be averaged over ``kept_mask``;
    * per-token float: ``importance_weight`` (``ρ``), ``approx_kl`` (``ℓ^θ − ℓ^prox``),
      ``clip_ratio`` / ``dual_clip_ratio`` (1 where that clip binds), ``behave_imp_weight``
      (``w``, or ``exp(ℓ^prox − ℓ^old)`` without rejection sampling), ``behave_approx_kl``
      (``ℓ^prox − ℓ^old``), ``new_logp``, ``old_logp``;
    * scalars: ``n_tokens`` (``count(M)``), ``n_valid_tokens`` (``count(M')``),
      ``n_masked_tokens`` (removed by rejection sampling).

    Per-token values are 0 outside ``M``.
    """
    if c_clip is not None and not c_clip > 1.0:
        raise ValueError(f"c_clip must be > 1 for the dual clip (got {c_clip})")
    mask = loss_mask.bool()
    old_logp, prox_logp = old_logp.detach(), prox_logp.detach()
    n_mb = mask.sum().clamp_min(1)
    sequence_terms = importance_sampling_level == "sequence" or (
        rejection is not None and rejection.level == "sequence"
    )
    rows = _Rows.of(mask, cu_seqlens) if sequence_terms else None

    raw_delta = (prox_logp - old_logp).float()
    delta = torch.where(torch.isfinite(raw_delta), raw_delta, 0.0)
    behave_weight = delta.exp()
    kept = mask
    if rejection is not None:
        kept, behave_weight = _rejection_sampling(delta, raw_delta, mask, rejection, rows)

    log_ratio = logprobs - prox_logp
    if importance_sampling_level == "sequence":
        assert rows is not None
        ratio, adv = _sequence_ratio(log_ratio, advantages, kept, rows)
    else:
        # exp of 0 at masked positions keeps their gradient finite
        ratio = torch.where(mask, log_ratio, 0.0).exp() * mask
        adv = advantages

    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_binds = clipped > unclipped
    dual_binds = torch.zeros_like(clip_binds)
    if c_clip is not None:
        bound = c_clip * adv.abs()
        dual_binds = (adv < 0) & (per_token > bound)
        per_token = torch.minimum(per_token, bound)
    if rejection is not None:
        per_token = per_token * behave_weight
    loss = torch.where(kept, per_token, 0.0).sum() / n_mb

    def on_mask(x: torch.Tensor) -> torch.Tensor:  # padding may hold ±inf; keep sums finite
        return torch.where(mask, x.detach(), 0.0)

    stats = {
        "loss_mask": mask,
        "kept_mask": kept,
        "importance_weight": ratio.detach(),
        "approx_kl": on_mask(log_ratio),
        "clip_ratio": (clip_binds & kept).float(),
        "dual_clip_ratio": (dual_binds & kept).float(),
        "behave_imp_weight": on_mask(behave_weight),
        "behave_approx_kl": on_mask(delta),
        "new_logp": on_mask(logprobs),
        "old_logp": on_mask(old_logp),
        "n_tokens": mask.sum(),
        "n_valid_tokens": kept.sum(),
        "n_masked_tokens": (mask & ~kept).sum(),
    }
    return loss, stats
