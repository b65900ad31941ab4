"""On-policy distillation's math (`vlmrl.algorithms.distill`) against its definitions: verl's estimator functions
and its top-k forward KL (ported below as verl writes them), Thinking Machines' discounted per-token advantage
written out as a sum, and distributions given by logits."""

from __future__ import annotations

import re

import pytest
import torch

from vlmrl.algorithms.aggregation import agg_loss, loss_normaliser
from vlmrl.algorithms.distill import (discounted_future_sum, distill_advantages, distill_metrics, forward_kl_topk,
                                      forward_kl_topk_loss, mixed_advantages, reverse_kl, reverse_kl_loss, topk_mass)


def verl_kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """verl's `kl_penalty_forward` (verl/trainer/ppo/core_algos.py), which its distillation estimator losses call with
    the teacher as ref_logprob (verl/trainer/distillation/losses.py), for the two estimators vlmrl ports."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise NotImplementedError(kl_penalty)


def verl_forward_kl_topk(student_logits: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                         teacher_topk_ids: torch.Tensor, log_prob_min_clamp: float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl's `compute_forward_kl_topk` (verl/trainer/distillation/fsdp/losses.py, loss_mode forward_kl_topk) without
    its sequence-parallel split and its overlap diagnostics: the student's full-vocabulary logprobs gathered at the
    teacher's top-k ids (its `_chunked_topk_log_probs`: logits.gather - logsumexp), the masses (each side's
    probabilities summed over those ids), then both sides clamp_min(log_prob_min_clamp) when set, then
    `kl_divergence(log_q=student, log_p=teacher)` = sum p (log p - log q); and the clamp at 0 its caller applies
    (verl/trainer/distillation/losses.py `compute_forward_kl_topk`: "divergences can be negative"). Returns (losses,
    student_mass, teacher_mass)."""
    logits = student_logits.float()
    student = torch.gather(logits, -1, teacher_topk_ids) - torch.logsumexp(logits, dim=-1, keepdim=True)
    teacher = teacher_topk_log_probs.float()
    student_mass, teacher_mass = student.exp().sum(-1), teacher.exp().sum(-1)
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    losses = (teacher.exp() * (teacher - student)).sum(dim=-1)
    return losses.clamp_min(0.0), student_mass, teacher_mass


def verl_loss_max_clamp(distillation_losses: torch.Tensor, loss_max_clamp: float | None) -> torch.Tensor:
    """verl's `distillation_loss` (verl/trainer/distillation/losses.py): the per-token losses clamped to [-c, c]
    ("clamping min is for k1 loss which can be negative") before the supervised aggregation or, negated, as the
    policy-gradient advantages."""
    if loss_max_clamp is not None:
        return distillation_losses.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    return distillation_losses


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


def _two_models(seed: int, vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """(2, 5, V) student and teacher logits, float64."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 5, vocab, generator=gen, dtype=torch.float64),
            torch.randn(2, 5, vocab, generator=gen, dtype=torch.float64) * 2)


@pytest.mark.parametrize("k", [1, 4, 11])
def test_forward_kl_topk_is_verls_and_a_direct_computation_from_the_two_models_logits(k):
    """The teacher's top-k ids and logprobs from its logits, the student's logprobs read at those ids: the loss equals
    verl's function and sum_{i in teacher top-k} p_t(i) log(p_t(i) / p_s(i)) from the two probability vectors; the
    masses verl's; k = V is the full KL(teacher || student), which torch's kl_div computes too."""
    student_logits, teacher_logits = _two_models(8)
    teacher_all = torch.log_softmax(teacher_logits, -1)
    top = teacher_all.topk(k, dim=-1)
    student_at = torch.log_softmax(student_logits, -1).gather(-1, top.indices)
    losses = forward_kl_topk(student_at, top.values)
    # verl computes in float32: its inputs and ours in float32, equal within float32 rounding
    verl_losses, verl_student_mass, verl_teacher_mass = verl_forward_kl_topk(student_logits.float(), top.values.float(),
                                                                             top.indices)
    torch.testing.assert_close(forward_kl_topk(student_at.float(), top.values.float()), verl_losses)
    torch.testing.assert_close(topk_mass(student_at.float()), verl_student_mass)
    torch.testing.assert_close(topk_mass(top.values.float()), verl_teacher_mass)
    p_s, p_t = torch.softmax(student_logits, -1), torch.softmax(teacher_logits, -1)
    in_top = torch.zeros_like(p_t).scatter(-1, top.indices, 1.0)
    torch.testing.assert_close(losses, (in_top * p_t * torch.log(p_t / p_s)).sum(-1).clamp_min(0.0))
    if k == 11:
        full = torch.nn.functional.kl_div(torch.log(p_s), torch.log(p_t), reduction="none", log_target=True).sum(-1)
        torch.testing.assert_close(losses, full)


@pytest.mark.parametrize("loss_max_clamp, log_prob_min_clamp", [(None, None), (0.3, None), (None, -1.5),
                                                                 (0.3, -1.5)])
def test_the_clamps_are_verls_in_both_modes(loss_max_clamp, log_prob_min_clamp):
    """verl's loss_max_clamp on k1 (which goes negative), k3 and the top-k forward KL, aggregated (the loss mode) or
    negated (the advantage mode's k1, discount 0), and its log_prob_min_clamp on the top-k logprobs, at values where
    they bind: the same losses and advantages as verl's functions, and no gradient through a clamped token."""
    student, teacher = _logprobs((3, 6), 11), _logprobs((3, 6), 12)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.float64)
    if loss_max_clamp is not None:
        assert (reverse_kl(student, teacher).abs() > loss_max_clamp).any(), "the clamp binds on these tokens"
    for estimator in ("k1", "k3"):
        expected = agg_loss(verl_loss_max_clamp(verl_kl_penalty_forward(student, teacher, estimator), loss_max_clamp),
                            mask, "token-mean")
        got = reverse_kl_loss(student, teacher, mask, estimator, "token-mean", loss_max_clamp=loss_max_clamp)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    advantages = -verl_loss_max_clamp(verl_kl_penalty_forward(student, teacher, "k1"), loss_max_clamp) * mask
    torch.testing.assert_close(distill_advantages(student, teacher, mask, loss_max_clamp=loss_max_clamp), advantages,
                               rtol=0, atol=0)
    student_logits, teacher_logits = _two_models(13)
    top = torch.log_softmax(teacher_logits, -1).topk(4, dim=-1)
    student_at = torch.log_softmax(student_logits, -1).gather(-1, top.indices).float().requires_grad_(True)
    if log_prob_min_clamp is not None:
        assert (top.values < log_prob_min_clamp).any() and (student_at < log_prob_min_clamp).any(), "it binds"
    verl = verl_loss_max_clamp(verl_forward_kl_topk(student_logits.float(), top.values.float(), top.indices,
                                                    log_prob_min_clamp)[0], loss_max_clamp)
    loss = forward_kl_topk_loss(student_at, top.values.float(), mask[:2, :5].float(), "token-mean",
                                loss_max_clamp=loss_max_clamp, log_prob_min_clamp=log_prob_min_clamp)
    torch.testing.assert_close(loss, agg_loss(verl, mask[:2, :5].float(), "token-mean"))
    loss.backward()
    if loss_max_clamp is not None:  # a token whose loss the clamp holds at its bound passes no gradient
        held = verl.detach() >= loss_max_clamp
        assert held.any() and not student_at.grad[held].any()


def test_a_student_above_the_teacher_on_its_top_k_gives_zero_top_k_loss_and_no_gradient():
    """Below the vocabulary the top-k sum goes negative where the student holds more of the teacher's ids than the
    teacher (here: the teacher's two ids at 0.3 and 0.2, the student's at 0.6 and 0.3): verl clamps it at 0, and so
    no gradient pushes the student further."""
    teacher = torch.log(torch.tensor([[[0.3, 0.2]]], dtype=torch.float64))
    student = torch.log(torch.tensor([[[0.6, 0.3]]], dtype=torch.float64)).requires_grad_(True)
    assert float((teacher.exp() * (teacher - student.detach())).sum()) < 0
    loss = forward_kl_topk_loss(student, teacher, torch.ones(1, 1, dtype=torch.float64), "token-mean")
    loss.backward()
    assert loss.item() == 0.0 and not student.grad.any()


def test_forward_kl_topk_is_zero_for_a_teacher_equal_to_the_student_with_zero_gradient_at_k_equal_v():
    """Equal models: 0 on every token for any k; at k = V the gradient of the student's logits is 0 too (the full
    forward KL's minimum; below V verl's unrenormalised loss still pushes mass into the teacher's top-k)."""
    logits, _ = _two_models(9)
    logits.requires_grad_(True)
    student = torch.log_softmax(logits, -1)
    top = student.detach().topk(3, dim=-1)
    assert torch.equal(forward_kl_topk(student.gather(-1, top.indices), top.values), torch.zeros(2, 5).double())
    forward_kl_topk_loss(student, student.detach(), torch.ones(2, 5, dtype=torch.float64), "token-mean").backward()
    torch.testing.assert_close(logits.grad, torch.zeros_like(logits), rtol=0, atol=1e-12)


def test_forward_kl_topk_loss_aggregates_as_verls_supervised_update():
    student_logits, teacher_logits = _two_models(10)
    top = torch.log_softmax(teacher_logits, -1).topk(3, dim=-1)
    student_at = torch.log_softmax(student_logits, -1).gather(-1, top.indices)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        normaliser = loss_normaliser(mask, mode, 5)
        expected = agg_loss(verl_forward_kl_topk(student_logits.float(), top.values.float(), top.indices)[0],
                            mask.float(), mode, normaliser)
        torch.testing.assert_close(forward_kl_topk_loss(student_at.float(), top.values.float(), mask.float(), mode,
                                                        normaliser), expected)


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
    topk = ["algorithm.distill.mode=loss", "algorithm.distill.estimator=forward_kl_topk"]
    for extra, says in [(["algorithm.distill.estimator=forward_kl_topk"], "set algorithm.distill.mode=loss"),
                        (topk + ["algorithm.distill.topk=0"], "topk=0 must be >= 1"),
                        (["algorithm.distill.loss_max_clamp=0"], "loss_max_clamp=0.0 must be > 0"),
                        (topk + ["algorithm.distill.log_prob_min_clamp=1"], "log_prob_min_clamp=1.0 must be < 0"),
                        (["algorithm.distill.log_prob_min_clamp=-10"],
                         "is read by estimator=forward_kl_topk only (as in verl), not k1")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(base + extra, check_model=False)
    sharded = load_config(base + topk + ["trainer.n_gpus_per_node=2"], check_model=False)  # the teacher FSDP-sharded
    assert sharded.algorithm.distill.estimator == "forward_kl_topk"
    config = load_config(base + ["algorithm.distill.mode=loss", "algorithm.distill.estimator=k3"], check_model=False)
    assert (config.algorithm.distill.mode, config.algorithm.distill.estimator) == ("loss", "k3")
