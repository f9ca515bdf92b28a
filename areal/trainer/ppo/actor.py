"""``PPOActor``: GRPO/PPO on top of a :class:`TrainEngine`.

* ``compute_logp(data)``: gradient-free log-probs of the current weights (``[B, L]``,
  position ``t`` scoring token ``t + 1``), used as ``prox_logp`` by the decoupled loss
  and, on the frozen reference model, as ``ref_logp`` by the KL penalty.
* ``compute_advantages(data, group_sizes)``: rewards to per-token advantages
  (docs/grpo.md#advantage-pipeline).
* ``ppo_update(data)``: ``ppo_n_minibatches`` optimizer steps, each a token mean of the
  clipped (decoupled) surrogate over the global minibatch.

``FSDPPPOActor`` and ``MegatronPPOActor`` are the FSDP and Megatron engines with these
three methods (megatron-core is only imported when a Megatron actor is initialized).
"""

from __future__ import annotations

from typing import Any

import torch

from areal.api.cli_args import PPOActorConfig
from areal.api.engine_api import PPOActorEngine, TrainEngine
from areal.engine.fsdp_engine import FSDPEngine
from areal.engine.megatron_engine import MegatronEngine
from areal.trainer.ppo.functions import compute_advantages, ppo_actor_loss, prox_logp_for_method
from areal.utils import stats_tracker
from areal.utils.packing import split_into_minibatches

__all__ = ["FSDPPPOActor", "MegatronPPOActor", "PPOActor"]

DROPPED_BEFORE_UPDATE = ("rewards", "tot_rewards", "kl_rewards")
UPDATE_SCOPE = "ppo_actor/update"
OPTIMIZER_STATS = ("grad_norm", "lr", "update_successful", "num_micro_batches")


def count_trainable(mb: dict[str, Any]) -> torch.Tensor:
    return mb["loss_mask"].count_nonzero()


class PPOActor:
    def __init__(self, config: PPOActorConfig, engine: TrainEngine):
        for flag in ("use_sapo_loss", "use_cispo_loss"):
            if getattr(config, flag):
                raise ValueError(
                    f"actor.{flag} is not implemented in this port; use the (decoupled) PPO loss"
                )
        self.config = config
        self.engine = engine

    # --- before the update ---

    @torch.no_grad()
    def compute_logp(self, data: dict[str, Any]) -> torch.Tensor:
        return self.engine.forward_batch(data)

    def compute_advantages(
        self, data: dict[str, Any], group_sizes: list[int] | None = None
    ) -> dict[str, Any]:
        group = getattr(self.engine, "data_parallel_group", None)
        out = compute_advantages(data, self.config, group_sizes, dp_group=group)
        self._log_batch(out, data)
        return out

    def _log_batch(self, out: dict[str, Any], data: dict[str, Any]) -> None:
        tracker = stats_tracker.get()
        with tracker.scope("ppo_actor"):
            mask = out["loss_mask"].bool()
            rows = torch.ones(mask.shape[0], dtype=torch.bool)
            task_reward = data.get("original_rewards", data["rewards"]).float()
            tracker.denominator(n_seqs=rows, n_valid_tokens=mask)
            tracker.stat(
                denominator="n_valid_tokens",
                advantages=out["advantages"].float(),
                kl_rewards=out["kl_rewards"].float(),
            )
            tracker.stat(
                denominator="n_seqs",
                task_reward=task_reward.cpu(),
                seq_len=data["attention_mask"].sum(1).float().cpu(),
            )
            self._log_batch_outcomes(tracker, out, data, mask, task_reward)

    def _log_batch_outcomes(self, tracker, out, data, mask, task_reward) -> None:
        """The rest of the per-batch stats (docs/grpo.md#logged-statistics): solved vs
        unsolved rows, prompt lengths, rows without EOS, the final per-token reward, and the
        loss settings."""
        cfg = self.config
        attention = data["attention_mask"].bool()
        seq_len = attention.sum(1).float().cpu()
        task_reward = task_reward.reshape(-1).cpu()
        correct = task_reward > 0
        tracker.denominator(
            n_tokens=attention, correct_n_seqs=correct.clone(), incorrect_n_seqs=~correct
        )
        tracker.stat(denominator="n_valid_tokens", final_reward=out["tot_rewards"].float())
        generated = data["loss_mask"].bool() & attention
        # like actor.mask_no_eos_with_zero: a row that fills the padded width had no EOS
        no_eos = (attention.sum(1) == attention.shape[1]).float().cpu()
        tracker.stat(
            denominator="n_seqs",
            prompt_len=(attention.sum(1) - generated.sum(1)).float().cpu(),
            no_eos_ratios=no_eos,
        )
        tracker.stat(denominator="correct_n_seqs", correct_seq_len=seq_len)
        tracker.stat(denominator="incorrect_n_seqs", incorrect_seq_len=seq_len)
        settings = {
            "eps_clip": cfg.eps_clip,
            "use_dual_clip": float(cfg.c_clip is not None),
            "mask_no_eos_with_zero": float(cfg.mask_no_eos_with_zero),
        }
        rejection = cfg.rejection_sampling
        if rejection is not None:  # the same config on every rank: the same keys
            settings["rs_upper"] = rejection.upper
            if rejection.lower is not None:
                settings["rs_lower"] = rejection.lower
        tracker.scalar(**{k: float(v) for k, v in settings.items()})

    # --- the update ---

    def ppo_update(self, data: dict[str, Any]) -> list[dict[str, float]]:
        data = {k: v for k, v in data.items() if k not in DROPPED_BEFORE_UPDATE}
        self.engine.train()
        group = getattr(self.engine, "cpu_group", None)
        parts = split_into_minibatches(data, self.config.ppo_n_minibatches, group=group)
        results = [self.engine.train_batch(part, self.loss, count_trainable) for part in parts]
        tracker = stats_tracker.get()
        with tracker.scope(UPDATE_SCOPE):
            for result in results:  # every key on every rank (the export all-reduces them)
                tracker.scalar(
                    **{k: float(result.get(k, 0.0)) for k in OPTIMIZER_STATS},
                )
        return results

    def _prox_logp(self, logprobs: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
        if not self.config.use_decoupled_loss:
            return mb["logprobs"]
        return prox_logp_for_method(
            self.config.prox_logp_method,
            logprobs=logprobs,
            old_logp=mb["logprobs"],
            prox_logp=mb.get("prox_logp"),
            versions=mb.get("versions"),
            current_version=self.engine.get_version(),
        )

    def loss(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: dict[str, Any]):
        """The GRPO loss of one packed micro-batch (``TrainEngine`` loss_fn contract)."""
        cfg = self.config
        loss, stats = ppo_actor_loss(
            logprobs,
            mb["logprobs"],
            self._prox_logp(logprobs, mb),
            mb["advantages"],
            mb["loss_mask"],
            eps_clip=cfg.eps_clip,
            eps_clip_higher=cfg.eps_clip_higher,
            c_clip=cfg.c_clip,
            rejection=cfg.rejection_sampling,
            importance_sampling_level=cfg.importance_sampling_level,
            cu_seqlens=mb.get("cu_seqlens"),
        )
        self._log_update(stats, logprobs, entropy, mb, loss)
        return loss

    def _log_update(self, stats, logprobs, entropy, mb, loss) -> None:
        tracker = stats_tracker.get()
        with tracker.scope(UPDATE_SCOPE):
            kept = stats["kept_mask"].bool()
            tracker.denominator(n_valid_tokens_in_loss=kept)
            per_token = {
                key: stats[key].detach().float()
                for key in (
                    "importance_weight",
                    "approx_kl",
                    "clip_ratio",
                    "dual_clip_ratio",
                    "behave_imp_weight",
                    "behave_approx_kl",
                )
                if key in stats
            }
            per_token["new_logp"] = logprobs.detach().float()
            per_token["entropy"] = entropy.detach().float()
            tracker.stat(denominator="n_valid_tokens_in_loss", **per_token)
            tracker.scalar(actor_loss=float(loss.detach()))
            self._log_update_details(tracker, stats, logprobs, mb)

    def _log_update_details(self, tracker, stats, logprobs, mb) -> None:
        """The rest of the ``update/`` stats (docs/grpo.md#logged-statistics): log-prob
        differences, clipped tokens, what rejection sampling removed, and how stale the
        trained tokens are."""
        mask, kept = stats["loss_mask"].bool(), stats["kept_mask"].bool()
        new_logp = torch.where(mask, logprobs.detach().float(), 0.0)
        old_logp = stats["old_logp"].float()
        diff = torch.where(mask, old_logp - new_logp, 0.0)
        tracker.stat(
            denominator="n_valid_tokens_in_loss",
            old_logp=old_logp,
            logp_diff=diff,
            logp_abs_diff=diff.abs(),
        )
        clipped = stats["clip_ratio"].bool() & kept
        tracker.denominator(n_total_tokens=mask, n_masked_tokens=mask & ~kept, n_clipped=clipped)
        tracker.stat(denominator="n_clipped", clipped_new_logp=new_logp, clipped_old_logp=old_logp)
        total = max(int(mask.sum()), 1)
        masked = float((mask & ~kept).sum()) / total
        # rejection sampling is this port's only behaviour-weight filter: both name it
        tracker.scalar(
            masked_token_ratio=masked, behave_filtered_ratio=masked, rs_filtered_fraction=masked
        )
        versions = mb.get("versions")
        if versions is not None:  # position t scores token t + 1: that token's version
            token_version = torch.roll(versions, -1, dims=-1).to(mask.device).reshape(mask.shape)
            versioned = kept & (token_version >= 0)
            staleness = (self.engine.get_version() - token_version).float()
            tracker.denominator(n_versioned_tokens=versioned)
            tracker.stat(denominator="n_versioned_tokens", version_staleness=staleness)


class _PPOActorMethods(PPOActorEngine):
    """The PPO actor's methods on a training engine (mixed in before the engine class), as
    :class:`PPOActorEngine` declares them for the train controller."""

    def __init__(self, config: PPOActorConfig):
        super().__init__(config)
        self.actor = PPOActor(config, self)

    def compute_logp(self, data: dict[str, Any]) -> torch.Tensor:
        return self.actor.compute_logp(data)

    def compute_advantages(
        self, data: dict[str, Any], group_sizes: list[int] | None = None
    ) -> dict[str, Any]:
        return self.actor.compute_advantages(data, group_sizes)

    def ppo_update(self, data: dict[str, Any]) -> list[dict[str, float]]:
        return self.actor.ppo_update(data)


class FSDPPPOActor(_PPOActorMethods, FSDPEngine):
    """The FSDP engine with the PPO actor's methods."""


class MegatronPPOActor(_PPOActorMethods, MegatronEngine):
    """The Megatron engine with the PPO actor's methods."""
