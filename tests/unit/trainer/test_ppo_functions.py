"""PPO/GRPO maths on hand-computed cases (expected numbers with their arithmetic)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from areal.api.cli_args import NormConfig, PPOActorConfig, RejectionSamplingConfig
from areal.trainer.ppo.functions import (
    Normalizer,
    compute_advantages,
    gae_token_level,
    gae_turn_level,
    kl_estimate,
    kl_rewards,
    normalize,
    ppo_actor_loss,
    prox_logp_for_method,
    shape_rewards,
)
from areal.trainer.ppo.lambda_fn import (
    build_lambda_context,
    constant_gae_lambda,
    gae_lambda_values,
    relative_position_gae_lambda,
    vapo_length_adaptive_gae,
)

EPS = 1e-5
# rewards [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt((4 x 0.25) / 3) = 0.577350
STD_1001 = math.sqrt(1.0 / 3.0)
R_1001 = 0.5 / (STD_1001 + EPS)  # = 0.866010


def close(actual: torch.Tensor, expected: list, tol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.double(), torch.tensor(expected, dtype=torch.float64), rtol=tol, atol=tol
    )


def group_norm(**kw) -> NormConfig:
    return NormConfig(mean_level="group", std_level="group", **kw)


# --- reward shaping and normalization --------------------------------------------------------


def test_shape_rewards_bias_scale_clip():
    # (-3 + 1) x 2 = -4; (0.5 + 1) x 2 = 3; (30 + 1) x 2 = 62 -> clipped to 5
    close(shape_rewards(torch.tensor([-3.0, 0.5, 30.0]), 1.0, 2.0, 5.0), [-4.0, 3.0, 5.0])


def test_group_norm_with_equal_rewards_and_a_one_row_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.7])
    out = normalize(rewards, group_norm(), group_sizes=[4, 3, 1])
    # group [1, 0, 0, 1]: +-0.5 / (0.577350 + 1e-5) = +-0.866010
    # group [1, 1, 1]: all equal -> (1 - 1) / (0 + eps) = 0
    # group [0.7]: mean 0.7 -> 0; one row -> unbiased std 1 -> 0 / (1 + eps) = 0
    close(out, [R_1001, -R_1001, -R_1001, R_1001, 0.0, 0.0, 0.0, 0.0])
    assert out.dtype == torch.float32


def test_group_norm_fixed_chunks_from_config_group_size():
    # chunks [1, 3] and [5, 7]: means 2 and 6, std = sqrt((1 + 1) / 1) = 1.414214
    out = normalize(torch.tensor([1.0, 3.0, 5.0, 7.0]), group_norm(group_size=2))
    r = 1.0 / (math.sqrt(2.0) + EPS)  # 0.707103
    close(out, [-r, r, -r, r])


def test_biased_std():
    # population std of [1, 0, 0, 1] = sqrt(1 / 4) = 0.5 -> +-0.5 / 0.50001 = +-0.99998
    out = normalize(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_norm(std_unbiased=False), None, [4])
    r = 0.5 / (0.5 + EPS)
    close(out, [r, -r, -r, r])


def test_leave_one_out_mean_without_std():
    cfg = NormConfig(mean_level="group", mean_leave1out=True, std_level=None)
    out = normalize(torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0]), cfg, group_sizes=[4, 1])
    # S = 2, N = 4: x = 1 -> mu = (2 - 1) / 3 = 1/3, output 2/3; x = 0 -> mu = 2/3, output -2/3
    # std level null -> sigma = 1 and eps = 0 (exact); one-row group -> mu = x -> 0
    close(out, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0], tol=1e-7)


def test_leave_one_out_with_group_std():
    cfg = group_norm(mean_leave1out=True)
    out = normalize(torch.tensor([1.0, 0.0, 0.0, 1.0]), cfg, group_sizes=[4])
    # centered values +-2/3; Q = 4 x 4/9 = 16/9; sigma = sqrt(16/9 / 3) = 0.769800
    r = (2 / 3) / (math.sqrt(16 / 27) + EPS)  # 0.866014
    close(out, [r, -r, -r, r])


def test_leave_one_out_token_level_with_mask():
    cfg = NormConfig(mean_level="batch", mean_leave1out=True, std_level=None)
    adv = torch.tensor([[1.0, 2.0, 9.0], [6.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # selected 1, 2, 6: S = 9, N = 3 -> mu = (9 - x) / 2 = 4, 3.5, 1.5
    close(normalize(adv, cfg, mask), [[1 - 4.0, 2 - 3.5, 0.0], [6 - 1.5, 0.0, 0.0]])


def test_batch_adv_norm_with_mask():
    cfg = NormConfig(mean_level="batch", std_level="batch")
    adv = torch.tensor([[1.0, 2.0, 3.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    # selected 1, 2, 5: N = 3, mean 8/3; Q = (25 + 4 + 49) / 9 = 78/9;
    # sigma = sqrt(78/9 / 2) = 2.081666; masked entries (the 3 and the zeros) -> 0
    sigma = math.sqrt(78 / 18) + EPS
    expected = [[(1 - 8 / 3) / sigma, (2 - 8 / 3) / sigma, 0.0], [(5 - 8 / 3) / sigma, 0.0, 0.0]]
    close(normalize(adv, cfg, mask), expected)
    close(Normalizer(cfg)(adv, mask), expected)


def test_null_levels_only_mask_and_missing_config_is_identity():
    adv = torch.tensor([[1.5, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1, 0], [0, 1]])
    close(normalize(adv, NormConfig(mean_level=None, std_level=None), mask), [[1.5, 0], [0, 4]])
    assert normalize(adv, None, mask) is adv


def test_all_zero_mask_returns_input_unchanged():
    adv = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    assert normalize(adv, NormConfig(), torch.zeros(1, 2)) is adv


def test_batch_level_all_reduces_in_an_initialized_group():
    # a one-rank gloo world: the all-reduce path runs and sums over a single rank
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = normalize(torch.tensor([1.0, 0.0, 0.0, 1.0]), NormConfig())
    finally:
        dist.destroy_process_group()
    close(out, [R_1001, -R_1001, -R_1001, R_1001])


# --- KL -----------------------------------------------------------------------------------------


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])  # delta = [0.5, -1]
    close(kl_estimate(logp, ref, "k1"), [0.5, -1.0])
    close(kl_estimate(logp, ref, "k2"), [0.125, 0.5])  # delta^2 / 2
    # exp(-0.5) - 1 + 0.5 = 0.106531; exp(1) - 1 - 1 = 0.718282
    close(kl_estimate(logp, ref, "k3"), [math.exp(-0.5) - 0.5, math.e - 2.0])
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


def test_kl_rewards_are_clamped_and_scaled():
    # k1: delta = [0.5, 30 -> clamped to 10]; x -kl_ctl (0.1)
    close(kl_rewards(torch.tensor([0.0, 0.0]), torch.tensor([-0.5, -30.0]), 0.1, "k1"), [-0.05, -1])


# --- GAE ----------------------------------------------------------------------------------------


def test_gae_token_level_gamma_lambda_one_broadcasts_the_reward():
    # row 0: n = 5 of L = 6, shifted mask M = [0, 1, 1, 1, 0, 0], R = 2 at n - 2 = 3
    # row 1: two model turns M = [0, 1, 0, 1, 1, 0], n = L, R = -1 at 4
    rewards = torch.tensor([[0, 0, 0, 2.0, 0, 0], [0, 0, 0, 0, -1.0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 1, 0, 1, 1, 0]])
    adv, ret = gae_token_level(rewards, torch.zeros(2, 6), mask, torch.tensor([5, 6]), 1.0, 1.0)
    # trainable positions get R; masked ones carry the next trainable value (0 past the
    # last one); A_{L-1} = 0
    close(adv, [[2, 2, 2, 2, 0, 0], [-1, -1, -1, -1, -1, 0]])
    close(ret, [[2, 2, 2, 2, 0, 0], [-1, -1, -1, -1, -1, 0]])


def test_gae_token_level_discount_and_values():
    # gamma = 0.5, lambda = 1, V = 0: A_3 = 1, A_2 = 0.5 x 1, A_1 = 0.25, A_0 (masked) = 0.25
    adv, _ = gae_token_level(
        torch.tensor([[0, 0, 0, 1.0, 0]]),
        torch.zeros(1, 5),
        torch.tensor([[0, 1, 1, 1, 0]]),
        torch.tensor([5]),
        0.5,
        1.0,
    )
    close(adv, [[0.25, 0.25, 0.5, 1.0, 0.0]])
    # gamma = 1, lambda = 0.5, V = [0, 1, 2, 0], n = L so V_next starts at V_3 = 0:
    # t = 2: delta = 1 + 0 - 2 = -1, A = -1;  t = 1: delta = 0 + V_2 - V_1 = 1,
    # A = 1 + 0.5 x (-1) = 0.5;  t = 0 masked: 0.5;  returns = A + V
    adv, ret = gae_token_level(
        torch.tensor([[0, 0, 1.0, 0]]),
        torch.tensor([[0, 1.0, 2.0, 0]]),
        torch.tensor([[0, 1, 1, 0]]),
        torch.tensor([4]),
        1.0,
        0.5,
    )
    close(adv, [[0.5, 0.5, -1.0, 0.0]])
    close(ret, [[0.5, 1.5, 1.0, 0.0]])


def test_gae_token_level_bootstraps_only_rows_that_fill_the_width():
    # V = [0, 1, 0, 3], M = [0, 1, 0, 0]: t = 1: delta = 0 + V_next - 1
    # n = L -> V_next = V_3 = 3 -> A = 2;  n < L -> V_next = 0 -> A = -1
    values = torch.tensor([[0, 1.0, 0, 3.0]]).repeat(2, 1)
    mask = torch.tensor([[0, 1, 0, 0]]).repeat(2, 1)
    adv, _ = gae_token_level(torch.zeros(2, 4), values, mask, torch.tensor([4, 3]), 1.0, 1.0)
    close(adv, [[2, 2, 0, 0], [-1, -1, 0, 0]])


def test_gae_token_level_last_column_never_updates():
    # the recursion starts at L - 2: a trainable last column keeps A = 0 and its reward is
    # never seen; t = 1: delta = 1 + 0 - 0 -> A = 1
    adv, _ = gae_token_level(
        torch.tensor([[0, 1.0, 5.0]]),
        torch.zeros(1, 3),
        torch.tensor([[0, 1, 1]]),
        torch.tensor([2]),
        1.0,
        1.0,
    )
    close(adv, [[1, 1, 0]])


def test_gae_token_level_per_row_lambda():
    # lambda = [1, 0]: row 1 keeps only the immediate delta, so A_1 = 0 there
    rewards = torch.tensor([[0, 0, 1.0, 0]]).repeat(2, 1)
    mask = torch.tensor([[0, 1, 1, 0]]).repeat(2, 1)
    lam = torch.tensor([1.0, 0.0])
    adv, _ = gae_token_level(rewards, torch.zeros(2, 4), mask, torch.tensor([4, 4]), 1.0, lam)
    close(adv, [[1, 1, 1, 0], [0, 0, 1, 0]])


def test_gae_turn_level_two_turns():
    # M = [0, 1, 1, 0, 1, 1, 0, 0]; turns u' = 0 at 1-2, 1 at 4-5; R = 1 at n - 2 = 5
    rewards = torch.tensor([[0, 0, 0, 0, 0, 1.0, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0, 0]])
    turns = torch.tensor([[-1, 0, 0, 0, 1, 1, 1, -1]])
    seq_lens = torch.tensor([7])
    # gamma = 1, lambda = 0.5, V = 0: A_1 = 1; A_0 = 0 + 0.5 x 1 = 0.5; masked positions 0
    adv, ret = gae_turn_level(rewards, torch.zeros(1, 8), mask, turns, seq_lens, 1.0, 0.5)
    close(adv, [[0, 0.5, 0.5, 0, 1, 1, 0, 0]])
    close(ret, [[0, 0.5, 0.5, 0, 1, 1, 0, 0]])
    # a turn's value is V at its first trainable position: V_0 = 1, V_1 = 2 (the 9s are ignored)
    # turn 1: delta = 1 + 0 - 2 = -1; turn 0: delta = 0 + V_1 - V_0 = 1, A = 1 + 0.5 x (-1)
    # returns: A + V_turn on trainable positions (1.5, 1), V_t elsewhere
    values = torch.tensor([[0, 1.0, 9.0, 0, 2.0, 9.0, 0, 0]])
    adv, ret = gae_turn_level(rewards, values, mask, turns, seq_lens, 1.0, 0.5)
    close(adv, [[0, 0.5, 0.5, 0, -1, -1, 0, 0]])
    close(ret, [[0, 1.5, 1.5, 0, 1, 1, 0, 0]])


def test_gae_turn_level_rejects_bad_turn_ids():
    def run(turn_ids: list[int]) -> None:
        zeros, mask = torch.zeros(1, 3), torch.tensor([[1, 1, 0]])
        gae_turn_level(zeros, zeros, mask, torch.tensor([turn_ids]), torch.tensor([3]), 1.0, 1.0)

    with pytest.raises(ValueError, match="not decrease"):
        run([1, 0, 0])
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        run([0, 3, 0])


# --- compute_advantages -----------------------------------------------------------------------


def _batch(rewards: list[float], lengths: list[int], prompt: int, width: int) -> dict:
    """Rows of `prompt` prompt tokens then model tokens (turn 0), right-padded to `width`."""
    rows = len(rewards)
    pos = torch.arange(width).expand(rows, width)
    n = torch.tensor(lengths)[:, None]
    attention = pos < n
    loss_mask = (attention & (pos >= prompt)).long()
    logprobs = -0.1 * (pos + 1).float() * loss_mask  # b_t = -0.1 (t + 1) on model tokens
    return {
        "input_ids": torch.where(attention, pos + 10, 0),
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "versions": torch.where(loss_mask.bool(), 3, -1),
        "turn_ids": torch.where(loss_mask.bool(), 0, -1),
        "rewards": torch.tensor(rewards),
    }


def actor(**kw) -> PPOActorConfig:
    kw.setdefault("kl_ctl", 0.0)
    return PPOActorConfig(**kw)


def test_compute_advantages_grpo_group_norm():
    batch = _batch([1.0, 0.0, 0.0, 1.0], [5, 6, 4, 6], prompt=2, width=6)
    out = compute_advantages(batch, actor(reward_norm=group_norm(group_size=4)), [4])
    # shifted M: row 0 (n = 5) -> [0, 1, 1, 1, 0, 0]; row 2 (n = 4) -> [0, 1, 1, 0, 0, 0]
    assert out["loss_mask"][0].tolist() == [0, 1, 1, 1, 0, 0]
    assert out["loss_mask"][1].tolist() == [0, 1, 1, 1, 1, 0]  # n = L: the wrap brings m_0 = 0
    assert out["loss_mask"][2].tolist() == [0, 1, 1, 0, 0, 0]
    # R = +-0.866010 on every trainable position; position 0 carries it (masked)
    r = R_1001
    close(out["advantages"][0], [r, r, r, r, 0, 0])
    close(out["advantages"][1], [-r, -r, -r, -r, -r, 0])
    close(out["advantages"][2], [-r, -r, -r, 0, 0, 0])
    # tot_rewards = outcome at n - 2 (row 1: n - 2 = 4), no KL
    close(out["tot_rewards"][1], [0, 0, 0, 0, -r, 0])
    close(out["kl_rewards"], torch.zeros(4, 6).tolist())
    # logprobs shifted and masked: l_old_t = b_{t+1} M_t, b_t = -0.1 (t + 1)
    close(out["logprobs"][0], [0, -0.3, -0.4, -0.5, 0, 0])
    # without the decoupled loss the proximal log-probs are the old ones
    assert out["prox_logp"] is out["logprobs"]
    # raw fields pass through unshifted
    assert out["rewards"] is batch["rewards"] and out["versions"] is batch["versions"]


def test_compute_advantages_batch_adv_norm_over_tokens():
    # one prompt token, so rows of n = 4 have shifted M = [1, 1, 1, 0]
    batch = _batch([1.0, 0.0], [4, 4], prompt=1, width=4)
    cfg = actor(reward_norm=group_norm(), adv_norm=NormConfig())
    out = compute_advantages(batch, cfg, [2])
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5 / 1) = 0.707107 -> R = +-0.707097
    r = 0.5 / (math.sqrt(0.5) + EPS)
    # tokens: three R and three -R -> mean 0, Q = 6 R^2, sigma = sqrt(6 R^2 / 5) = 0.774586
    a = r / (math.sqrt(6 * r * r / 5) + EPS)  # 0.912859
    close(out["advantages"], [[a, a, a, 0], [-a, -a, -a, 0]])


def test_compute_advantages_kl_penalty_and_no_eos_masking():
    batch = _batch([1.0, 1.0], [4, 3], prompt=1, width=4)
    batch["ref_logp"] = torch.full((2, 4), -0.5)
    cfg = actor(kl_ctl=0.5, kl_estimator="k1", mask_no_eos_with_zero=True)
    out = compute_advantages(batch, cfg, [2])
    # row 1 (n = 3): M = [1, 1, 0, 0], l_old = [b_1, b_2, 0, 0] = [-0.2, -0.3, 0, 0]
    # k = -0.5 x (l_old - l_ref) = [-0.5 x 0.3, -0.5 x 0.2, 0, 0]
    close(out["kl_rewards"][1], [-0.15, -0.1, 0, 0])
    # outcome R = 1 at n - 2 = 1; A_1 = -0.1 + 1 = 0.9, A_0 = -0.15 + 0.9 = 0.75
    close(out["tot_rewards"][1], [-0.15, 0.9, 0, 0])
    close(out["advantages"][1], [0.75, 0.9, 0, 0])
    # row 0 fills the width (no EOS): reward 0; k = [-0.15, -0.1, -0.05, 0] summed backwards
    close(out["advantages"][0], [-0.3, -0.15, -0.05, 0])
    close(out["ref_logp"], [[-0.5, -0.5, -0.5, 0], [-0.5, -0.5, 0, 0]])


def test_compute_advantages_old_logprob_sources():
    batch = _batch([1.0], [3], prompt=1, width=3)  # M = [1, 1, 0], b = [0, -0.2, -0.3]
    recomputed = torch.tensor([[-7.0, -8.0, -9.0]])
    # recompute without the decoupled loss: prox_logp (masked) replaces the old log-probs
    cfg = actor(recompute_logprob=True)
    out = compute_advantages({**batch, "prox_logp": recomputed}, cfg, None)
    close(out["logprobs"], [[-7.0, -8.0, 0]])
    assert out["prox_logp"] is out["logprobs"]
    with pytest.raises(ValueError, match="prox_logp"):
        compute_advantages(batch, cfg, None)
    # decoupled: old = shifted behaviour log-probs, prox_logp stays as recomputed (unmasked)
    cfg = actor(use_decoupled_loss=True)
    out = compute_advantages({**batch, "prox_logp": recomputed}, cfg, None)
    close(out["logprobs"], [[-0.2, -0.3, 0]])
    assert out["prox_logp"] is recomputed


def test_compute_advantages_turn_level_with_vapo_lambda():
    # one row, two model turns: tokens 0 prompt, 1-2 turn 0, 3 tool output, 4-5 turn 1
    batch = _batch([1.0], [6], prompt=1, width=7)
    batch["loss_mask"] = torch.tensor([[0, 1, 1, 0, 1, 1, 0]])
    batch["turn_ids"] = torch.tensor([[-1, 0, 0, -1, 1, 1, -1]])
    cfg = actor(
        gae_timestep_unit="turn",
        gae_lambda="areal.trainer.ppo.lambda_fn.vapo_length_adaptive_gae",
        gae_lambda_kwargs={"alpha": 1.5},
    )
    out = compute_advantages(batch, cfg, [1])
    # K = 2 turns -> lambda = 1 - 1 / (1.5 x 2) = 2/3; turn 1 gets R = 1, turn 0 gets 2/3
    # shifted: M = [1, 1, 0, 1, 1, 0, 0], u' = [0, 0, -1, 1, 1, -1, -1]
    close(out["advantages"], [[2 / 3, 2 / 3, 0, 1, 1, 0, 0]])


def test_compute_advantages_overlong_penalty_is_not_supported():
    cfg = actor(overlong_reward_penalty=True, overlong_tokens=4, overlong_penalty_factor=1.0)
    with pytest.raises(NotImplementedError, match="overlong"):
        compute_advantages(_batch([1.0], [3], 1, 3), cfg, None)


# --- the loss -----------------------------------------------------------------------------------


def token_loss(ratio: float, adv: float, **kw) -> tuple[float, dict]:
    """The loss of a single trainable token with ``ρ = ratio`` (``ℓ^θ − ℓ^prox = log ρ``)."""
    logp = torch.tensor([math.log(ratio)])
    zero = torch.zeros(1)
    kw.setdefault("eps_clip", 0.2)
    loss, stats = ppo_actor_loss(logp, zero, zero, torch.tensor([adv]), torch.ones(1), **kw)
    return loss.item(), stats


@pytest.mark.parametrize(
    ("ratio", "adv", "expected", "clipped"),
    [
        (1.1, 1.0, -1.1, 0),  # inside [0.8, 1.2]: -A rho
        (1.1, -1.0, 1.1, 0),
        (1.5, 1.0, -1.2, 1),  # max(-1.5, -1.2) = -1.2: clipped
        (1.5, -1.0, 1.5, 0),  # max(1.5, 1.2) = 1.5: the pessimistic term is unclipped
        (0.5, 1.0, -0.5, 0),  # max(-0.5, -0.8)
        (0.5, -1.0, 0.8, 1),  # max(0.5, 0.8) = 0.8: clipped
    ],
)
def test_clipped_surrogate(ratio, adv, expected, clipped):
    loss, stats = token_loss(ratio, adv)
    assert loss == pytest.approx(expected, abs=1e-6)
    assert stats["clip_ratio"].item() == clipped


def test_clip_higher_and_dual_clip():
    # eps_high 0.28: max(-1.5, -1.28) = -1.28
    assert token_loss(1.5, 1.0, eps_clip_higher=0.28)[0] == pytest.approx(-1.28)
    # dual clip c = 3, A = -1, rho = 5: max(5, 1.2) = 5 -> min(5, 3 x 1) = 3
    loss, stats = token_loss(5.0, -1.0, c_clip=3.0)
    assert loss == pytest.approx(3.0) and stats["dual_clip_ratio"].item() == 1
    # positive advantages are never dual-clipped: max(-5, -1.2) = -1.2
    loss, stats = token_loss(5.0, 1.0, c_clip=3.0)
    assert loss == pytest.approx(-1.2) and stats["dual_clip_ratio"].item() == 0
    with pytest.raises(ValueError):
        token_loss(1.0, 1.0, c_clip=1.0)


def test_gradient_flows_only_through_unclipped_tokens():
    logp = torch.log(torch.tensor([1.1, 1.5])).requires_grad_()
    zero = torch.zeros(2)
    loss, _ = ppo_actor_loss(logp, zero, zero, torch.ones(2), torch.ones(2), eps_clip=0.2)
    loss.backward()
    # d(-A rho / N)/d logp = -A rho / N = -1.1 / 2 for the first; the clipped one gets 0
    close(logp.grad, [-0.55, 0.0])


def test_masked_positions_with_infinite_logprobs_keep_finite_gradients():
    logp = torch.tensor([0.0, -torch.inf]).requires_grad_()
    zero = torch.zeros(2)
    loss, _ = ppo_actor_loss(logp, zero, zero, torch.ones(2), torch.tensor([1, 0]), eps_clip=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0) and torch.isfinite(logp.grad).all()


def _rejection_case(rejection: RejectionSamplingConfig) -> tuple[float, dict]:
    # rho = 1 everywhere (logp = prox) and A = 1, so each kept token contributes -w;
    # behaviour weights w = exp(prox - old) = [2, 6, 0.25]; the last token is outside M
    prox = torch.log(torch.tensor([2.0, 6.0, 0.25]))
    mask = torch.tensor([1, 1, 0])
    loss, stats = ppo_actor_loss(
        prox, torch.zeros(3), prox, torch.ones(3), mask, eps_clip=0.2, rejection=rejection
    )
    return loss.item(), stats


def test_token_rejection_mask_keeps_rejected_tokens_in_the_denominator():
    loss, stats = _rejection_case(RejectionSamplingConfig(level="token", action="mask", upper=5))
    # w = 6 > 5 is dropped; N_mb = 2 still counts it: loss = (-2) / 2 = -1
    assert loss == pytest.approx(-1.0)
    assert stats["kept_mask"].tolist() == [True, False, False]
    close(stats["behave_imp_weight"], [2.0, 0.0, 0.0])
    assert (stats["n_tokens"].item(), stats["n_valid_tokens"].item()) == (2, 1)
    assert stats["n_masked_tokens"].item() == 1


def test_token_rejection_clamp():
    loss, _ = _rejection_case(RejectionSamplingConfig(level="token", action="clamp", upper=5))
    # w = [2, clamp(6) = 5]: loss = (-2 - 5) / 2 = -3.5
    assert loss == pytest.approx(-3.5)


def test_token_rejection_with_a_kl_metric():
    prox = torch.tensor([0.5, 0.2])  # k2 = delta^2 / 2 = [0.125, 0.02]
    cfg = RejectionSamplingConfig(level="token", metric="kl_k2", upper=0.1)
    loss, stats = ppo_actor_loss(
        prox, torch.zeros(2), prox, torch.ones(2), torch.ones(2), eps_clip=0.2, rejection=cfg
    )
    # only the second token is kept, with its weight exp(0.2): loss = -exp(0.2) / 2
    assert stats["kept_mask"].tolist() == [False, True]
    assert loss.item() == pytest.approx(-math.exp(0.2) / 2)


def _sequence_case(rejection: RejectionSamplingConfig, packed: bool) -> tuple[float, dict]:
    # row 0 weights [2, 8] -> mean log = ln 4 (geometric mean 4); row 1 weights [8, 8] -> 8;
    # rho = 1 and A = 1, so each kept token contributes -w
    w = torch.tensor([[2.0, 8.0], [8.0, 8.0]])
    mask = torch.ones(2, 2)
    kw = {}
    if packed:  # the same rows as one stream, padded with two unused tokens
        w = torch.cat([w.reshape(-1), torch.ones(2)])
        mask = torch.cat([mask.reshape(-1), torch.zeros(2)])
        kw["cu_seqlens"] = torch.tensor([0, 2, 4])
    prox = w.log()
    loss, stats = ppo_actor_loss(
        prox,
        torch.zeros_like(w),
        prox,
        torch.ones_like(w),
        mask,
        eps_clip=0.2,
        rejection=rejection,
        **kw,
    )
    return loss.item(), stats


@pytest.mark.parametrize("packed", [False, True])
def test_sequence_rejection_mask(packed):
    cfg = RejectionSamplingConfig(level="sequence", action="mask", agg="mean", upper=5)
    loss, stats = _sequence_case(cfg, packed)
    # row 0: geometric mean 4 <= 5 kept, both tokens weigh 4; row 1: 8 > 5 dropped
    # loss = (-4 - 4) / 4 (N_mb counts the dropped row)
    assert loss == pytest.approx(-2.0)
    assert stats["kept_mask"].reshape(-1)[:4].tolist() == [True, True, False, False]
    # agg sum: row 0 -> exp(ln 2 + ln 8) = 16 > 5, dropped too; max: 8 > 5
    for agg in ("sum", "max"):
        cfg = RejectionSamplingConfig(level="sequence", action="mask", agg=agg, upper=5)
        assert _sequence_case(cfg, packed)[0] == pytest.approx(0.0)


def test_sequence_rejection_clamp():
    cfg = RejectionSamplingConfig(level="sequence", action="clamp", agg="mean", upper=5)
    loss, stats = _sequence_case(cfg, packed=False)
    # row 0 in bounds: weights 4 (not clamped); row 1 out of bounds: 8 -> 5
    close(stats["behave_imp_weight"], [[4, 4], [5, 5]])
    assert loss == pytest.approx(-(4 + 4 + 5 + 5) / 4)


def test_gspo_sequence_ratio():
    # per-token log ratio [0.1, 0.3] -> mean 0.2 -> rho = exp(0.2) = 1.221403 for both;
    # A = [1, 3] -> mean 2; clipped: max(-2 x 1.2214, -2 x 1.2) = -2.4 per token
    logp = torch.tensor([[0.1, 0.3]])
    zero = torch.zeros(1, 2)
    loss, stats = ppo_actor_loss(
        logp,
        zero,
        zero,
        torch.tensor([[1.0, 3.0]]),
        torch.ones(1, 2),
        eps_clip=0.2,
        importance_sampling_level="sequence",
    )
    assert loss.item() == pytest.approx(-2.4)
    close(stats["importance_weight"], [[math.exp(0.2), math.exp(0.2)]])
    with pytest.raises(ValueError, match="cu_seqlens"):
        ppo_actor_loss(
            logp[0],
            zero[0],
            zero[0],
            zero[0],
            torch.ones(2),
            eps_clip=0.2,
            importance_sampling_level="sequence",
        )


def test_empty_micro_batch_has_zero_loss():
    zero = torch.zeros(3)
    loss, stats = ppo_actor_loss(zero, zero, zero, torch.ones(3), zero, eps_clip=0.2)
    assert loss.item() == 0.0 and stats["n_valid_tokens"].item() == 0


# --- proximal log-probs -----------------------------------------------------------------------


def test_prox_logp_methods():
    old, theta = torch.full((5,), -1.0), torch.full((5,), -3.0, requires_grad=True)
    recomputed = torch.full((5,), -2.0)
    assert (
        prox_logp_for_method("recompute", logprobs=theta, old_logp=old, prox_logp=recomputed)
        is not None
    )
    reused = prox_logp_for_method("reuse_train_logp", logprobs=theta, old_logp=old)
    assert not reused.requires_grad and reused.tolist() == theta.tolist()
    # v_theta = 5, versions [4, 3, 5, -1, 6] -> gap [1, 2, 0, 6, -1]
    # alpha = (gap - 1) / gap where gap > 0 and v >= 0: [0, 0.5, 0, 0 (v < 0), 0]
    # prox = old + alpha (theta - old) = -1 + alpha x (-2)
    prox = prox_logp_for_method(
        "loglinear",
        logprobs=theta,
        old_logp=old,
        versions=torch.tensor([4, 3, 5, -1, 6]),
        current_version=5,
    )
    close(prox, [-1.0, -2.0, -1.0, -1.0, -1.0])


def test_prox_logp_errors():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="prox_logp"):
        prox_logp_for_method("recompute", logprobs=x, old_logp=x)
    with pytest.raises(ValueError, match="versions"):
        prox_logp_for_method("loglinear", logprobs=x, old_logp=x)
    with pytest.raises(RuntimeError, match="NaN"):
        prox_logp_for_method(
            "metrics", logprobs=x, old_logp=x, prox_logp=torch.tensor([0, math.nan])
        )
    with pytest.raises(ValueError, match="unknown"):
        prox_logp_for_method("guess", logprobs=x, old_logp=x)


# --- λ functions --------------------------------------------------------------------------------


def _context(lengths: list[int]):
    width = max(lengths) + 1
    mask = torch.arange(width).expand(len(lengths), width) < torch.tensor(lengths)[:, None]
    return build_lambda_context(mask, None, "token")


def test_builtin_lambda_functions():
    ctx = _context([0, 1, 2, 4])
    close(constant_gae_lambda(ctx, value=0.9), [0.9] * 4)
    # 1 - 1 / (1.5 L): L = 0 -> 0; 1 -> 1/3; 2 -> 2/3; 4 -> 5/6
    close(vapo_length_adaptive_gae(ctx, alpha=1.5), [0.0, 1 / 3, 2 / 3, 5 / 6])
    ctx = _context([0, 1, 2, 3])
    # q^(1 / (L - 1)) with q = 0.5: L = 2 -> 0.5; L = 3 -> sqrt(0.5); L = 1 -> 1; L = 0 -> 0
    close(relative_position_gae_lambda(ctx, q=0.5), [0.0, 1.0, 0.5, math.sqrt(0.5)])
    with pytest.raises(ValueError):
        vapo_length_adaptive_gae(ctx, alpha=0.0)
    with pytest.raises(ValueError):
        relative_position_gae_lambda(ctx, q=1.5)


def test_lambda_context_counts_turns_of_trainable_positions():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0]])
    turns = torch.tensor([[5, 0, 0, 7, 2, -1], [3, 3, 9, 9, 9, -1]])
    ctx = build_lambda_context(mask, turns, "turn")
    assert ctx.effective_token_lengths.tolist() == [3, 2]
    assert ctx.turn_counts.tolist() == [2, 1]  # {0, 2} and {3}: masked ids do not count
    assert ctx.timestep_lengths.tolist() == [2, 1]
    assert build_lambda_context(mask, None, "token").turn_counts.tolist() == [0, 0]


def test_lambda_resolver():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert gae_lambda_values(0.95, {}, mask, None, "token") == 0.95
    lam = gae_lambda_values(
        "areal.trainer.ppo.lambda_fn.relative_position_gae_lambda", {"q": 0.25}, mask, None, "token"
    )
    close(lam, [0.25, 1.0])  # L = 2 -> 0.25^(1/1); L = 1 -> 1


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("tests.unit.trainer.test_ppo_functions.bad_shape_lambda", ValueError),
        ("tests.unit.trainer.test_ppo_functions.nan_lambda", ValueError),
        ("tests.unit.trainer.test_ppo_functions.int_lambda", TypeError),
        ("tests.unit.trainer.test_ppo_functions.float_lambda", TypeError),
    ],
)
def test_lambda_results_are_validated(path, error):
    with pytest.raises(error, match="λ function"):
        gae_lambda_values(path, {}, torch.ones(2, 3), None, "token")


def bad_shape_lambda(context):
    return torch.ones(context.rows + 1)


def nan_lambda(context):
    return torch.full((context.rows,), math.nan)


def int_lambda(context):
    return torch.ones(context.rows, dtype=torch.long)


def float_lambda(context):
    return 0.5
