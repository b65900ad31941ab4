"""GRPO math on CPU: advantages by group, PPO-clip token-mean loss, KL estimators, entropy."""

from __future__ import annotations

import doctest

import pytest
import torch

from vlmrl.algorithms import grpo
from vlmrl.algorithms.grpo import (
    entropy_from_logits,
    group_advantages,
    kl_penalty,
    logprobs_from_logits,
    ppo_clip_loss,
    token_mean,
)


def test_docstring_examples_hold():
    failures, tried = doctest.testmod(grpo)
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
