"""On-policy distillation's math (`vlmrl.algorithms.distill`) against its definitions: verl's estimator functions
(ported below as verl writes them), Thinking Machines' discounted per-token advantage written out as a sum, and
distributions given by logits."""

from __future__ import annotations

import re

import pytest
import torch

from vlmrl.algorithms.aggregation import agg_loss, loss_normaliser
from vlmrl.algorithms.distill import (discounted_future_sum, distill_advantages, distill_metrics, mixed_advantages,
                                      reverse_kl, reverse_kl_loss)


def verl_kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """verl's `kl_penalty_forward` (verl/trainer/ppo/core_algos.py), which its distillation estimator losses call with
    the teacher as ref_logprob (verl/trainer/distillation/losses.py), for the two estimators vlmrl ports."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise NotImplementedError(kl_penalty)


def _logprobs(shape: tuple[int, ...], seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return -scale * torch.rand(shape, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_estimators_are_verls(estimator):
    """Random logprobs, plus the cases verl's clamps decide: a teacher far below or above the student (|log ratio|
    past 20, a k3 past 10) and equal ones."""
    student = torch.cat([_logprobs((4, 16), 0), torch.tensor([[-1.0, -30.0, -0.1, -5.0] * 4], dtype=torch.float64)])
    teacher = torch.cat([_logprobs((4, 16), 1), torch.tensor([[-1.0, -0.1, -30.0, -5.0] * 4], dtype=torch.float64)])
    torch.testing.assert_close(reverse_kl(student, teacher, estimator),
                               verl_kl_penalty_forward(student, teacher, estimator), rtol=0, atol=0)


def test_the_loss_aggregates_as_verls_supervised_update():
    """verl: agg_loss(kl_penalty(student, teacher), response_mask, loss_agg_mode), for every aggregation mode (with
    the mini-batch normaliser the update passes)."""
    student, teacher = _logprobs((3, 5), 2), _logprobs((3, 5), 3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float64)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        normaliser = loss_normaliser(mask, mode, 5)
        expected = agg_loss(verl_kl_penalty_forward(student, teacher, "k3"), mask, mode, normaliser)
        torch.testing.assert_close(reverse_kl_loss(student, teacher, mask, "k3", mode, normaliser), expected)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_a_teacher_equal_to_the_student_gives_zero_on_every_token(estimator):
    """Advantage and loss are 0 on every token; k3's gradient too (k1's is the score function, 0 in expectation
    only, as it is in verl)."""
    student = _logprobs((4, 8), 4).requires_grad_(True)
    teacher = student.detach().clone()
    mask = (torch.arange(8) < torch.tensor([[8], [5], [1], [0]])).to(torch.float64)
    assert torch.equal(reverse_kl(student, teacher, estimator), torch.zeros(4, 8, dtype=torch.float64))
    assert torch.equal(distill_advantages(student.detach(), teacher, mask, discount=0.9),
                       torch.zeros(4, 8, dtype=torch.float64))
    loss = reverse_kl_loss(student, teacher, mask, estimator, "token-mean")
    assert loss.item() == 0.0
    if estimator == "k3":
        loss.backward()
        assert torch.equal(student.grad, torch.zeros_like(student))


@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
def test_the_advantage_is_the_discounted_sum_of_future_negative_reverse_kls(discount):
    """Thinking Machines' per-token advantage written out: A_t = coef * sum_{k>=0} discount^k * r_{t+k}, r = -(log
    p_s - log p_t) on the mask's tokens and 0 elsewhere (a masked position still counts in the exponent, as in the
    cookbook's sum over positions); A is 0 outside the mask."""
    student, teacher = _logprobs((3, 6), 5), _logprobs((3, 6), 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.float64)
    rewards = torch.where(mask != 0, teacher - student, torch.zeros(()))
    expected = torch.zeros(3, 6, dtype=torch.float64)
    for b in range(3):
        for t in range(6):
            if mask[b, t]:
                expected[b, t] = 0.7 * sum(discount ** k * rewards[b, t + k] for k in range(6 - t))
    torch.testing.assert_close(distill_advantages(student, teacher, mask, discount, coef=0.7), expected)


def test_the_estimators_and_advantage_equal_a_direct_computation_from_logits():
    """Two distributions given by logits (B, R, V), tokens sampled from the student: the functions over the sampled
    tokens' logprobs give -(log p_s - log p_t) and p_t/p_s - log(p_t/p_s) - 1 computed from the probabilities."""
    gen = torch.Generator().manual_seed(7)
    student_logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64)
    teacher_logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64)
    tokens = torch.distributions.Categorical(logits=student_logits).sample()
    p_s = torch.softmax(student_logits, -1).gather(-1, tokens[..., None])[..., 0]
    p_t = torch.softmax(teacher_logits, -1).gather(-1, tokens[..., None])[..., 0]
    student = torch.log_softmax(student_logits, -1).gather(-1, tokens[..., None])[..., 0]
    teacher = torch.log_softmax(teacher_logits, -1).gather(-1, tokens[..., None])[..., 0]
    mask = torch.ones(2, 5, dtype=torch.float64)
    torch.testing.assert_close(distill_advantages(student, teacher, mask), -torch.log(p_s / p_t))
    torch.testing.assert_close(reverse_kl(student, teacher, "k3"), p_t / p_s - torch.log(p_t / p_s) - 1)


def test_discount_zero_and_one():
    values = torch.tensor([[1.0, -2.0, 3.0]])
    assert discounted_future_sum(values, 0.0).tolist() == [[1.0, -2.0, 3.0]]
    assert discounted_future_sum(values, 1.0).tolist() == [[2.0, 1.0, 3.0]]


def test_the_reward_advantage_is_weighed_beside_the_distillation_advantage():
    """reward_weight 0 = pure distillation; without per-token advantages (loss mode) the (B,) advantages stay (B,)."""
    reward = torch.tensor([1.0, -1.0], dtype=torch.float64)
    distill = torch.tensor([[0.5, 0.25], [0.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    assert mixed_advantages(reward, distill, mask, 0.0).tolist() == [[0.5, 0.0], [0.0, 2.0]]
    assert mixed_advantages(reward, distill, mask, 2.0).tolist() == [[2.5, 0.0], [-2.0, 0.0]]
    assert mixed_advantages(reward, None, mask, 0.5).tolist() == [0.5, -0.5]


def test_metrics_are_means_over_the_masks_tokens():
    student = torch.tensor([[-1.0, -9.0], [-3.0, -9.0]])
    teacher = torch.tensor([[-2.0, -9.0], [-2.0, -9.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert distill_metrics(student, teacher, mask) == {"distill/reverse_kl": 0.0, "distill/teacher_logprob": -2.0,
                                                       "distill/student_logprob": -2.0}


def test_the_config_refuses_what_distillation_cannot_run_and_says_what_to_change():
    from vlmrl.config import ConfigError, load_config

    base = ["actor.model_path=tiny", "data.train_files=synthetic", "data.val_files=synthetic",
            "algorithm.distill.teacher=tiny"]
    assert not load_config(base[:3], check_model=False).algorithm.distill.enabled, "off by default"
    for extra, says in [(["algorithm.distill.mode=sft"], "is not one of ['advantage', 'loss']"),
                        (["algorithm.distill.estimator=k3"], "set algorithm.distill.mode=loss or estimator=k1"),
                        (["algorithm.distill.discount=1.5"], "must be in [0, 1]"),
                        (["algorithm.distill.mode=loss", "algorithm.distill.discount=0.5"], "applies to mode=advantage"),
                        (["algorithm.distill.coef=0", "algorithm.distill.reward_weight=0"], "nothing to learn")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(base + extra, check_model=False)
    config = load_config(base + ["algorithm.distill.mode=loss", "algorithm.distill.estimator=k3"], check_model=False)
    assert (config.algorithm.distill.mode, config.algorithm.distill.estimator) == ("loss", "k3")
