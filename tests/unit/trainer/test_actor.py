"""The PPO actor end to end on CPU: GRPO on a fixed rewarded batch moves the policy."""

from __future__ import annotations

import pytest
import torch

from areal.api.cli_args import MicroBatchSpec, NormConfig, OptimizerConfig, PPOActorConfig
from areal.trainer.ppo.actor import FSDPPPOActor

PROMPT_LEN, COMPLETION_LEN, GROUPS, GROUP_SIZE = 5, 6, 2, 4


def rewarded_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Two prompts x four sampled completions; the completions starting with token 50 win."""
    g = torch.Generator().manual_seed(3)
    rows, rewards = [], []
    for _ in range(GROUPS):
        prompt = torch.randint(3, 120, (PROMPT_LEN,), generator=g)
        for sample in range(GROUP_SIZE):
            completion = torch.randint(3, 120, (COMPLETION_LEN,), generator=g)
            winner = sample % 2 == 0
            completion[0] = 50 if winner else 60
            rows.append(torch.cat([prompt, completion]))
            rewards.append(1.0 if winner else 0.0)
    ids = torch.stack(rows)
    n, width = ids.shape
    loss_mask = torch.zeros(n, width, dtype=torch.long)
    loss_mask[:, PROMPT_LEN:] = 1
    turn_ids = torch.where(loss_mask.bool(), 0, -1)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(n, width, dtype=torch.bool),
        "loss_mask": loss_mask,
        "versions": torch.where(loss_mask.bool(), 0, -1),
        "turn_ids": turn_ids,
        "rewards": torch.tensor(rewards),
    }
    return batch, torch.tensor(rewards).bool()


@pytest.fixture
def actor(tiny_model_dir):
    config = PPOActorConfig(
        experiment_name="test",
        trial_name="actor",
        path=str(tiny_model_dir),
        dtype="float32",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=64),
        optimizer=OptimizerConfig(lr=5e-3, warmup_steps_proportion=0.0),
        ppo_n_minibatches=2,
        eps_clip=0.2,
        kl_ctl=0.0,
        reward_norm=NormConfig(mean_level="group", std_level="group"),
        adv_norm=NormConfig(mean_level="batch", std_level="batch"),
        use_decoupled_loss=True,
        recompute_logprob=True,
        prox_logp_method="recompute",
    )
    actor = FSDPPPOActor(config)
    actor.create_process_group()
    actor.initialize()
    yield actor
    actor.destroy()


def completion_logp(actor, batch) -> torch.Tensor:
    """Mean log-prob of each row's completion tokens under the current weights."""
    shifted = actor.compute_logp(batch)  # position t scores token t + 1
    scored = shifted[:, PROMPT_LEN - 1 : -1]
    return scored.mean(dim=1)


def test_grpo_raises_rewarded_completions_and_lowers_the_rest(actor):
    batch, winners = rewarded_batch()
    before = completion_logp(actor, batch)
    for _ in range(3):  # three rollout-and-train steps on the same prompts
        behaviour = actor.compute_logp(batch)
        data = dict(batch)
        data["logprobs"] = torch.roll(behaviour, 1, dims=1)  # unshifted: logp of token t
        data["prox_logp"] = behaviour
        data = actor.compute_advantages(data, group_sizes=[GROUP_SIZE] * GROUPS)
        stats = actor.ppo_update(data)
        assert len(stats) == 2 and all(s["update_successful"] == 1.0 for s in stats)
        actor.lr_scheduler_step()
    after = completion_logp(actor, batch)
    gain = after - before
    assert gain[winners].mean() > 0.05, gain
    assert gain[winners].mean() > gain[~winners].mean() + 0.05, gain


def test_unsupported_losses_are_refused(tiny_model_dir):
    config = PPOActorConfig(
        experiment_name="test", trial_name="actor", path=str(tiny_model_dir), use_sapo_loss=True
    )
    with pytest.raises(ValueError, match="use_sapo_loss is not implemented"):
        FSDPPPOActor(config)
