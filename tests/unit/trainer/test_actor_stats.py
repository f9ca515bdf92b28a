"""The per-step ``ppo_actor/*`` stats after a GRPO step on CPU (docs/grpo.md#logged-statistics)."""

from __future__ import annotations

import pytest
import torch

from areal.api.cli_args import MicroBatchSpec, NormConfig, OptimizerConfig, PPOActorConfig
from areal.trainer.ppo.actor import FSDPPPOActor
from areal.utils import stats_tracker

PROMPT, COMPLETION, ROWS = 3, 4, 4


def test_one_step_records_the_spec_stats(tiny_model_dir):
    config = PPOActorConfig(
        experiment_name="test",
        trial_name="actor-stats",
        path=str(tiny_model_dir),
        dtype="float32",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=64),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps_proportion=0.0),
        ppo_n_minibatches=1,
        eps_clip=0.2,
        kl_ctl=0.0,
        reward_norm=NormConfig(mean_level="group", std_level="group"),
        use_decoupled_loss=True,
        recompute_logprob=True,
        prox_logp_method="recompute",
    )
    actor = FSDPPPOActor(config)
    actor.create_process_group()
    actor.initialize()
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 120, (ROWS, PROMPT + COMPLETION), generator=g)
        loss_mask = torch.zeros_like(ids)
        loss_mask[:, PROMPT:] = 1
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids, dtype=torch.bool),
            "loss_mask": loss_mask,
            "versions": torch.where(loss_mask.bool(), 0, -1),
            "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        }
        stats_tracker.export_all()  # start clean
        behaviour = actor.compute_logp(batch)
        batch["logprobs"] = torch.roll(behaviour, 1, dims=1)
        batch["prox_logp"] = behaviour
        actor.ppo_update(actor.compute_advantages(batch, group_sizes=[ROWS]))
        stats = actor.export_stats()
    finally:
        actor.destroy()

    batch_keys = [
        "n_seqs", "n_tokens", "n_valid_tokens", "correct_n_seqs", "incorrect_n_seqs",
        "advantages/avg", "final_reward/avg", "task_reward/avg", "seq_len/avg",
        "prompt_len/avg", "no_eos_ratios/avg", "correct_seq_len/avg", "incorrect_seq_len/avg",
        "eps_clip", "use_dual_clip", "mask_no_eos_with_zero",
    ]  # fmt: skip
    update_keys = [
        "importance_weight/avg", "approx_kl/avg", "new_logp/avg", "old_logp/avg",
        "entropy/avg", "actor_loss", "clip_ratio/avg", "dual_clip_ratio/avg", "logp_diff/avg",
        "logp_abs_diff/avg", "behave_imp_weight/avg", "behave_approx_kl/avg",
        "behave_filtered_ratio", "rs_filtered_fraction", "n_total_tokens",
        "n_valid_tokens_in_loss", "n_masked_tokens", "masked_token_ratio",
        "version_staleness/avg", "grad_norm", "lr", "update_successful", "num_micro_batches",
    ]  # fmt: skip
    missing = [k for k in batch_keys if f"ppo_actor/{k}" not in stats]
    missing += [k for k in update_keys if f"ppo_actor/update/{k}" not in stats]
    assert not missing, missing
    # 4 rows of 3 + 4 tokens; rewards 1, 0, 1, 0; the shifted loss mask scores the 4
    # completion tokens of each row from positions 2..5 (3 - 1 ... 7 - 2): 16 tokens
    assert stats["ppo_actor/n_tokens"] == 28
    assert (stats["ppo_actor/correct_n_seqs"], stats["ppo_actor/incorrect_n_seqs"]) == (2, 2)
    assert stats["ppo_actor/prompt_len/avg"] == 3
    assert stats["ppo_actor/n_valid_tokens"] == 16
    assert stats["ppo_actor/update/n_total_tokens"] == 16
    assert stats["ppo_actor/update/n_masked_tokens"] == 0  # no rejection sampling
    assert stats["ppo_actor/update/version_staleness/avg"] == 0  # version 0 trains version 0
    assert stats["ppo_actor/eps_clip"] == pytest.approx(0.2)
    assert stats["ppo_actor/update/update_successful"] == 1.0
    # the weights that produced the behaviour log-probs are the ones trained: ratio 1
    assert stats["ppo_actor/update/importance_weight/avg"] == pytest.approx(1.0, abs=1e-5)
