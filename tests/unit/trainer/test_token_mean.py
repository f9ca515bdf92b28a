"""Token-mean loss over micro-batches (docs/grpo.md#actor-loss, step 9), as plain tensor maths.

Each micro-batch loss is ``Σ L_t / N_mb``; the engine scales it by ``N_mb / W`` where ``W`` is
the trainable-token count of the whole minibatch. The sum is then ``Σ L_t / W``: the token
mean of the single batch, not a mean of per-micro-batch means.
"""

from __future__ import annotations

import pytest
import torch

from areal.api.cli_args import RejectionSamplingConfig
from areal.trainer.ppo.functions import ppo_actor_loss


def mb_loss(per_token: list[float], mask: list[int], **kw) -> torch.Tensor:
    """A micro-batch whose token losses are ``per_token`` (ρ = 1, A = −L, nothing clipped)."""
    adv = -torch.tensor(per_token)
    zero = torch.zeros_like(adv)
    loss, _ = ppo_actor_loss(zero, zero, zero, adv, torch.tensor(mask), eps_clip=0.2, **kw)
    return loss


def test_hand_computed_token_mean_over_micro_batches():
    # mb 1: losses [1, 2] -> 1.5 over 2 tokens; mb 2: loss [6] -> 6 over 1 token; W = 3
    # scaled: 1.5 x 2/3 + 6 x 1/3 = 1 + 2 = 3 = (1 + 2 + 6) / 3, the token mean
    # (a mean of micro-batch means would give (1.5 + 6) / 2 = 3.75)
    total = mb_loss([1.0, 2.0], [1, 1]) * 2 / 3 + mb_loss([6.0], [1]) * 1 / 3
    assert total.item() == pytest.approx(3.0)
    assert mb_loss([1.0, 2.0, 6.0], [1, 1, 1]).item() == pytest.approx(3.0)


def test_empty_micro_batch_contributes_nothing():
    # N_mb = max(1, 0) = 1 and the weight 0 / W: mb 2 adds 0; W = 2 -> (1 + 3) / 2
    total = mb_loss([1.0, 3.0], [1, 1]) * 2 / 2 + mb_loss([9.0], [0]) * 0 / 2
    assert total.item() == pytest.approx(2.0)


def _random_batch(rows: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = torch.arange(width).expand(rows, width) < lengths[:, None]
    old = -torch.rand(rows, width, generator=g)
    return {
        "theta": old + 0.3 * torch.randn(rows, width, generator=g),
        "old": old,
        "prox": old + 0.5 * torch.randn(rows, width, generator=g),
        "adv": torch.randn(rows, width, generator=g),
        "mask": mask,
    }


def _loss(batch: dict, logp: torch.Tensor, rows: slice, **kw) -> torch.Tensor:
    loss, _ = ppo_actor_loss(
        logp[rows],
        batch["old"][rows],
        batch["prox"][rows],
        batch["adv"][rows],
        batch["mask"][rows],
        eps_clip=0.2,
        **kw,
    )
    return loss


@pytest.mark.parametrize(
    "rejection",
    [None, RejectionSamplingConfig(level="token", action="mask", upper=1.5, lower=0.7)],
)
def test_scaled_micro_batches_equal_the_single_batch_loss_and_gradient(rejection):
    batch = _random_batch(rows=7, width=9, seed=0)
    micro_batches = [slice(0, 2), slice(2, 3), slice(3, 7)]
    counts = [int(batch["mask"][mb].sum()) for mb in micro_batches]
    total_tokens = sum(counts)  # W, counted before rejection sampling

    logp_full = batch["theta"].clone().requires_grad_()
    full = _loss(batch, logp_full, slice(None), rejection=rejection)
    full.backward()

    logp_mb = batch["theta"].clone().requires_grad_()
    scaled = sum(
        _loss(batch, logp_mb, mb, rejection=rejection) * count / total_tokens
        for mb, count in zip(micro_batches, counts)
    )
    scaled.backward()

    torch.testing.assert_close(scaled, full)
    torch.testing.assert_close(logp_mb.grad, logp_full.grad)


def test_data_parallel_scaling_gives_the_global_token_mean():
    # two "ranks": each scales its micro-batch by count / W x dp_size, then gradient
    # averaging divides the summed gradients by dp_size again
    batch = _random_batch(rows=6, width=5, seed=1)
    ranks = [[slice(0, 1), slice(1, 3)], [slice(3, 6)]]
    total_tokens = int(batch["mask"].sum())
    dp_size = len(ranks)

    logp_full = batch["theta"].clone().requires_grad_()
    _loss(batch, logp_full, slice(None)).backward()

    grads = []
    for rank in ranks:
        logp = batch["theta"].clone().requires_grad_()
        for mb in rank:
            weight = int(batch["mask"][mb].sum()) / total_tokens * dp_size
            (_loss(batch, logp, mb) * weight).backward()
        grads.append(logp.grad)
    torch.testing.assert_close(sum(grads) / dp_size, logp_full.grad)
