"""GRPO math on CPU: advantages by group, PPO-clip token-mean loss, KL estimators, entropy; and the four numeric defects
found against the peers (each test below fails on the code before the fix)."""

from __future__ import annotations

import doctest

import pytest
import torch

from vlmrl.algorithms import advantages, aggregation, correction, dapo, grpo, policy_loss
from vlmrl.algorithms.grpo import (
    entropy_from_logits,
    group_advantages,
    kl_penalty,
    logprobs_from_logits,
    ppo_clip_loss,
    token_mean,
)


@pytest.mark.parametrize("module", [advantages, aggregation, correction, dapo, grpo, policy_loss])
def test_docstring_examples_hold(module):
    failures, tried = doctest.testmod(module)
    assert tried > 0 and failures == 0


def test_each_group_is_normalised_on_its_own():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 5.0, 7.0, 9.0])
    uids = ["a"] * 4 + ["b"] * 4
    adv = group_advantages(rewards, uids)
    for rows in (slice(0, 4), slice(4, 8)):
        assert adv[rows].mean().abs() < 1e-6
        assert adv[rows].std() == pytest.approx(1.0, abs=1e-4)
    # group b is an affine copy of a linear ramp: same advantages as any other ramp
    assert torch.allclose(adv[4:], group_advantages(torch.arange(4.0), ["x"] * 4), atol=1e-5)


def test_rows_need_not_be_contiguous_by_group():
    rewards = torch.tensor([1.0, 10.0, 0.0, 20.0])
    adv = group_advantages(rewards, ["a", "b", "a", "b"])
    assert adv[0] > 0 > adv[2] and adv[3] > 0 > adv[1]
    assert torch.allclose(adv[[0, 2]], adv[[3, 1]], atol=1e-5)


def test_std_normalisation_can_be_switched_off():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, ["a"] * 4, norm_by_std=False)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_padding_rows_get_zero_and_do_not_move_group_statistics():
    rewards = torch.tensor([1.0, 0.0, 1.0, 100.0, -50.0])
    uids = ["a", "a", "a", "a", "pad-1"]
    padding = torch.tensor([False, False, False, True, True])
    adv = group_advantages(rewards, uids, is_padding=padding)
    expected = group_advantages(rewards[:3], uids[:3])
    assert torch.equal(adv[:3], expected)
    assert adv[3] == 0 and adv[4] == 0


def test_groups_with_equal_rewards_and_singletons_get_zero_not_nan():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.7]), ["a", "a", "a", "lonely"])
    assert torch.equal(adv, torch.zeros(4))


def test_advantages_reject_mismatched_uids():
    with pytest.raises(ValueError, match="len\\(uids\\)"):
        group_advantages(torch.zeros(3), ["a", "a"])


def test_ppo_loss_is_minus_advantage_weighted_token_mean_inside_the_trust_region():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = ppo_clip_loss(logprobs, logprobs.detach(), advantages, mask)
    # ratio 1 everywhere: loss = -(1+1+1-2-2)/5
    assert out.loss.item() == pytest.approx(0.2)
    out.loss.backward()
    assert torch.allclose(logprobs.grad, -advantages * mask / 5)
    assert out.clip_fraction.item() == 0.0 and out.approx_kl.item() == 0.0


def test_ppo_loss_stops_pushing_outside_the_clip_range():
    old = torch.zeros(1, 4)
    # ratios e^0.5 (too high) for positive advantages and e^-0.5 (too low) for negative ones: both are clipped
    logprobs = torch.tensor([[0.5, 0.5, -0.5, -0.5]], requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    out = ppo_clip_loss(logprobs, old, advantages, torch.ones(1, 4))
    out.loss.backward()
    grad = logprobs.grad[0]
    assert grad[0] == 0 and grad[2] == 0, "clipped tokens must not get a gradient"
    assert grad[1] != 0 and grad[3] != 0, "tokens the clip does not bind on keep their gradient"
    assert out.clip_fraction.item() == pytest.approx(0.5)


def test_clip_higher_widens_only_the_upper_bound():
    logprobs = torch.full((1, 1), 0.25, requires_grad=True)  # ratio 1.284
    out = ppo_clip_loss(logprobs, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.28)
    assert out.clip_fraction.item() == 1.0
    out = ppo_clip_loss(logprobs, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.3)
    assert out.clip_fraction.item() == 0.0


def test_micro_batch_losses_sum_to_the_mini_batch_token_mean():
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(8, 6, generator=gen)
    old = logprobs + 0.1 * torch.randn(8, 6, generator=gen)
    advantages = torch.randn(8, 1, generator=gen).expand(8, 6)
    lengths = torch.tensor([6, 1, 3, 4, 2, 5, 6, 3])
    mask = (torch.arange(6) < lengths[:, None]).float()
    whole = ppo_clip_loss(logprobs, old, advantages, mask).loss
    total_tokens = mask.sum()
    parts = sum(ppo_clip_loss(logprobs[i : i + 1], old[i : i + 1], advantages[i : i + 1], mask[i : i + 1],
                              num_tokens=total_tokens).loss for i in range(8))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)
    # a per-micro-batch mean (what the num_tokens argument avoids) would weight short responses up
    naive = sum(ppo_clip_loss(logprobs[i : i + 1], old[i : i + 1], advantages[i : i + 1], mask[i : i + 1]).loss
                for i in range(8)) / 8
    assert abs(naive.item() - whole.item()) > 1e-3


def test_token_mean_of_no_tokens_is_zero():
    assert token_mean(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0


def test_low_var_kl_is_k3_nonnegative_and_second_order_near_zero():
    logprobs = torch.tensor([[-1.0, -1.0, -1.0, -2.0]])
    ref = torch.tensor([[-1.0, -1.01, -0.5, -1.0]])
    kl = kl_penalty(logprobs, ref, "low_var_kl")
    log_ratio = ref - logprobs
    assert torch.allclose(kl, torch.exp(log_ratio) - log_ratio - 1)
    assert (kl >= 0).all() and kl[0, 0] == 0
    assert kl[0, 1].item() == pytest.approx(0.5 * 0.01**2, rel=1e-2)


def test_low_var_kl_is_clamped_for_extreme_ratios():
    kl = kl_penalty(torch.tensor([[-100.0]]), torch.tensor([[0.0]]), "low_var_kl")
    assert kl.item() == 10.0


def test_kl_gradient_pulls_policy_towards_reference():
    logprobs = torch.tensor([[-2.0]], requires_grad=True)
    kl_penalty(logprobs, torch.tensor([[-1.0]]), "low_var_kl").sum().backward()
    assert logprobs.grad.item() < 0  # descending the loss raises the logprob towards the reference's


@pytest.mark.parametrize("kind, expected", [("k1", -0.5), ("k2", 0.125), ("mse", 0.125)])
def test_other_kl_estimators(kind, expected):
    assert kl_penalty(torch.tensor([[-1.5]]), torch.tensor([[-1.0]]), kind).item() == pytest.approx(expected)


def test_unknown_kl_type_names_the_choices():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_entropy_and_logprobs_match_torch_distributions():
    gen = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(2, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    dist = torch.distributions.Categorical(logits=logits)
    assert torch.allclose(entropy_from_logits(logits), dist.entropy(), atol=1e-5)
    assert torch.allclose(logprobs_from_logits(logits, labels), dist.log_prob(labels), atol=1e-5)


def test_entropy_is_stable_for_huge_logits():
    logits = torch.tensor([[1e4, 0.0, -1e4]])
    assert torch.isfinite(entropy_from_logits(logits)).all()


# --- the four defects -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reward", [0.1, 0.9, 1.0, 0.3, 1e-3, 7.0])
@pytest.mark.parametrize("n", [2, 3, 5, 6, 7, 8, 9, 12, 13, 16, 64])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_a_group_with_equal_rewards_gets_exactly_zero(reward, n, norm_by_std):
    # before: the float32 group mean of 8 x 0.9 differs from 0.9 in the last bit, and / (std + 1e-6) made it -0.056
    adv = group_advantages(torch.full((n,), reward), ["a"] * n, norm_by_std=norm_by_std)
    assert torch.equal(adv, torch.zeros(n)), adv


def test_equal_groups_stay_zero_next_to_groups_with_signal():
    rewards = torch.tensor([0.9] * 8 + [0.1, 0.9, 1.0, 0.1])
    adv = group_advantages(rewards, ["a"] * 8 + ["b"] * 4)
    assert torch.equal(adv[:8], torch.zeros(8))
    assert adv[8:].abs().min() > 0.1


def test_dual_clip_caps_a_negative_advantage_token_at_clip_ratio_c():
    # the case: ratio e^2 with A = -1 gave e^2 = 7.39; verl (clip_ratio_c) and EasyR1 (clip_ratio_dual) give 3
    logprobs = torch.tensor([[2.0]], requires_grad=True)
    out = ppo_clip_loss(logprobs, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1))
    assert out.loss.item() == pytest.approx(3.0)
    out.loss.backward()
    assert logprobs.grad.item() == 0.0, "a dual-clipped token must not push"
    assert out.metrics["dual_clip_fraction"].item() == 1.0
    # the cap is clip_ratio_c * |A|, and None turns it off (the old behaviour)
    assert ppo_clip_loss(logprobs, torch.zeros(1, 1), torch.full((1, 1), -2.0), torch.ones(1, 1),
                         clip_ratio_c=5.0).loss.item() == pytest.approx(10.0)
    unbounded = ppo_clip_loss(logprobs, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), clip_ratio_c=None)
    assert unbounded.loss.item() == pytest.approx(float(torch.exp(torch.tensor(2.0))))


def test_dual_clip_leaves_positive_advantages_and_moderate_ratios_alone():
    logprobs = torch.tensor([[2.0, 0.5, 1.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    out = ppo_clip_loss(logprobs, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_ratio_c=3.0)
    # token 0: A > 0, clipped at 1.2 -> -1.2; token 1: e^0.5 = 1.65 < 3 -> 1.65; token 2: e^1 = 2.72 < 3 -> 2.72
    expected = (-1.2 + float(torch.exp(torch.tensor(0.5))) + float(torch.exp(torch.tensor(1.0)))) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("clip_ratio_c", [1.0, 0.5])
def test_dual_clip_must_exceed_one(clip_ratio_c):
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                      clip_ratio_c=clip_ratio_c)


def test_token_mean_divides_by_a_normaliser_below_one():
    # a sharded rank passes global_tokens / world_size: 1 token over 2 ranks = 0.5 each (was clamped to 1)
    values, mask = torch.tensor([[3.0, 9.0]]), torch.tensor([[1.0, 0.0]])
    assert token_mean(values, mask, 0.5).item() == 6.0
    assert token_mean(values, mask, torch.tensor(0.25)).item() == 12.0
    # only a zero normaliser is guarded (nothing to average over)
    assert token_mean(values, torch.zeros(1, 2), 0).item() == 0.0


def test_sharded_token_mean_averages_to_the_global_mean_when_tokens_are_fewer_than_ranks():
    # 1 real token in a global mini-batch held by 2 ranks (the other rank has only a padding row)
    values = [torch.tensor([[5.0, 0.0]]), torch.tensor([[7.0, 0.0]])]
    masks = [torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2)]
    world = 2
    global_tokens = sum(m.sum() for m in masks)
    rank_losses = [token_mean(v, m, global_tokens / world) for v, m in zip(values, masks, strict=True)]
    assert (sum(rank_losses) / world).item() == 5.0  # the global token mean; the clamp gave 2.5


def test_nan_and_inf_at_masked_positions_do_not_poison_masked_sums():
    values = torch.tensor([[1.0, float("nan")], [float("inf"), 3.0], [-float("inf"), 0.0]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    assert token_mean(values, mask).item() == 2.0  # values * mask gave NaN (inf * 0 = NaN)
    assert grpo.masked_sum(values, mask).item() == 4.0


def test_nan_logprobs_at_masked_positions_change_neither_loss_nor_gradient():
    gen = torch.Generator().manual_seed(3)
    clean = -torch.rand(3, 5, generator=gen)
    old = clean + 0.1 * torch.randn(3, 5, generator=gen)
    adv = torch.randn(3, 1, generator=gen).expand(3, 5).clone()
    mask = torch.tensor([[1.0] * 5, [1.0, 1.0, 1.0, 0.0, 0.0], [0.0] * 5])
    dirty_lp, dirty_old, dirty_adv = clean.clone(), old.clone(), adv.clone()
    hole = mask == 0
    dirty_lp[hole], dirty_old[hole], dirty_adv[hole] = float("nan"), -float("inf"), float("inf")
    grads = []
    for lp, o, a in ((clean, old, adv), (dirty_lp, dirty_old, dirty_adv)):
        lp = lp.clone().requires_grad_(True)
        out = ppo_clip_loss(lp, o, a, mask)
        out.loss.backward()
        grads.append((out.loss.detach(), lp.grad))
    assert torch.isfinite(grads[1][0]) and grads[1][0] == grads[0][0]
    assert torch.equal(grads[1][1], grads[0][1]) and (grads[1][1][hole] == 0).all()


def test_broadcast_ignores_nan_advantages_of_fully_masked_rows():
    adv = torch.tensor([1.5, float("nan")])
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    assert torch.equal(grpo.broadcast_to_tokens(adv, mask), torch.tensor([[1.5, 0.0], [0.0, 0.0]]))
