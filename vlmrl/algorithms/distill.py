"""On-policy distillation math: the student's own sampled tokens, scored by the student and by a teacher, turned into
a per-token advantage or a loss. Pure functions over tensors (no config, no process group, no device assumption).

Shapes: B = rows, R = padded response length. `student` and `teacher` are (B, R) logprobs of the SAME sampled tokens
(the student's samples; both scored at rollout.temperature, the distribution the student sampled from: at 1, the
plain models', as in both anchors), `mask` the (B, R) loss mask (1 = policy token).

What the anchors define, and how this matches:
- Thinking Machines, "On-Policy Distillation" (2025) and its Tinker cookbook (`incorporate_kl_penalty`): the per-token
  reward is the negative reverse KL of the sampled token, -(log p_student - log p_teacher) (k1), times
  kl_penalty_coef, optionally summed over the future tokens with kl_discount_factor (default 0: each token's own), and
  ADDED to the advantages the environment gave (zero rewards in their distillation recipe). `distill_advantages` is
  that sum, term for term: `coef` is kl_penalty_coef, `discount` kl_discount_factor, and the future sum runs over the
  row's positions as theirs does (a masked position adds 0 but still counts in the discount's exponent). Differences:
  the cookbook takes the student's logprobs from the sampler; here the caller passes the trainer's (the old-logprob
  pass; the engine's with algorithm.rollout_correction=bypass), and the reward's advantage is weighed by
  `reward_weight` (`mixed_advantages`) where the cookbook adds it at weight 1.
- verl (#5041, `verl/trainer/distillation/losses.py`): the estimator losses are core_algos' `kl_penalty(logprob,
  ref_logprob=teacher)`: k1 = log p_s - log p_t; k3 (low_var_kl) = r - log r - 1 with log r = log p_t - log p_s
  clamped to [-20, 20] and the result to [-10, 10]. `reverse_kl` is exactly those two (they are
  `vlmrl.algorithms.grpo.kl_penalty`'s k1 and low_var_kl). Its supervised update aggregates them with the actor's
  loss_agg_mode over the response mask and adds distillation_loss_coef times that to the policy loss (our
  mode=loss, `coef`); its policy-gradient update uses -losses.detach() as advantages with no discount (our
  mode=advantage with discount 0). Its `loss_max_clamp` (distillation_loss.loss_max_clamp: the per-token losses
  clamped to [-c, c] before either use; off by default, 10 in its examples) is `clamp_losses`, applied by every
  function here that takes `loss_max_clamp`.
- verl's top-k forward KL (#5041, loss_mode `forward_kl_topk`, `verl/trainer/distillation/fsdp/losses.py`
  `compute_forward_kl_topk` with `distillation_loss.topk`): the teacher returns its K most likely tokens per position
  with their logprobs, the student's log_softmax over the WHOLE vocabulary is read at those ids (no
  renormalisation over the K), and the per-token loss is sum_k p_t(k) (log p_t(k) - log p_s(k)), the forward KL
  KL(teacher || student) restricted to the teacher's top-k support; its diagnostics `teacher_mass` and
  `student_mass` are each side's probability summed over those ids. `forward_kl_topk` and `topk_mass` are those,
  term for term (estimator `forward_kl_topk`, loss mode only, as in verl), with its `log_prob_min_clamp` (both
  sides' top-k logprobs clamped from below before the sum; off by default, -10 in its examples) and the
  dispatcher's clamp of the per-token loss at 0 (`losses.py` `compute_forward_kl_topk`: below the vocabulary the two
  sides' masses differ, and a student holding more of the teacher's top-k than the teacher does gives a negative
  sum). Not ported: the `_tail` variant's tail bucket and its overlap diagnostics.
"""

from __future__ import annotations

import torch

from vlmrl.algorithms.aggregation import agg_loss, zero_outside
from vlmrl.algorithms.grpo import broadcast_to_tokens, kl_penalty

ESTIMATOR_KL_TYPES = {"k1": "k1", "k3": "low_var_kl"}
TOPK_ESTIMATOR = "forward_kl_topk"
"""algorithm.distill.estimator of the forward KL over the teacher's top-k (verl's loss_mode of the same name)."""
"""algorithm.distill.estimator -> the `kl_penalty` kind that computes it (verl's names for the same estimators)."""


def reverse_kl(student: torch.Tensor, teacher: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """(B, R) per-token estimate of KL(student || teacher) from the sampled tokens' logprobs; the gradient flows
    through `student` only.

    k1 = log p_s - log p_t (unbiased, can be negative); k3 = p_t/p_s - log(p_t/p_s) - 1 (>= 0, lower variance).

    >>> reverse_kl(torch.tensor([[-1.0]]), torch.tensor([[-3.0]])).item()
    2.0
    >>> round(reverse_kl(torch.tensor([[-1.0]]), torch.tensor([[-3.0]]), "k3").item(), 6)  # e^-2 + 2 - 1
    1.135335
    """
    if estimator not in ESTIMATOR_KL_TYPES:
        raise ValueError(f"unknown distillation estimator {estimator!r}; choose one of {list(ESTIMATOR_KL_TYPES)}")
    return kl_penalty(student, teacher, ESTIMATOR_KL_TYPES[estimator])


def clamp_losses(losses: torch.Tensor, loss_max_clamp: float | None) -> torch.Tensor:
    """verl's distillation_loss.loss_max_clamp: per-token losses clamped to [-c, c] (the lower side for k1, which can
    be negative); None = as they are. A clamped token passes no gradient, as in verl.

    >>> clamp_losses(torch.tensor([-12.0, 3.0, 15.0]), 10.0).tolist()
    [-10.0, 3.0, 10.0]
    """
    return losses if loss_max_clamp is None else losses.clamp(-loss_max_clamp, loss_max_clamp)


def reverse_kl_loss(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, estimator: str, mode: str,
                    normaliser: float | torch.Tensor | None = None, loss_max_clamp: float | None = None
                    ) -> torch.Tensor:
    """The distillation loss (mode=loss, before its coefficient): `reverse_kl`, clamped by `clamp_losses`, aggregated
    over the loss mask by actor.loss_agg_mode `mode` (`vlmrl.algorithms.aggregation.agg_loss`, with the mini-batch's
    `normaliser` when a micro-batch passes it), as verl aggregates its estimator losses.

    >>> reverse_kl_loss(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -2.0]]), torch.ones(1, 2), "k1",
    ...                 "token-mean").item()
    0.5
    """
    return agg_loss(clamp_losses(reverse_kl(student, teacher, estimator), loss_max_clamp), mask, mode, normaliser)


def forward_kl_topk(student_topk: torch.Tensor, teacher_topk: torch.Tensor, log_prob_min_clamp: float | None = None
                    ) -> torch.Tensor:
    """(B, R): sum over the teacher's top-k ids of p_t (log p_t - log p_s), from (B, R, K) logprobs at those ids
    (each side's log_softmax over the whole vocabulary, read at the teacher's K ids), at least 0 (verl's clamp: below
    the vocabulary the sum can go negative where the student holds more of those ids than the teacher); the
    gradient flows through `student_topk` only. K = the vocabulary gives KL(teacher || student) exactly.
    `log_prob_min_clamp` (verl's): both sides' logprobs clamped from below first. Computed in float32 at least, as
    verl's.

    >>> s, t = torch.tensor([[[-1.0, -2.0]]]), torch.tensor([[[-0.5, -1.5]]])
    >>> round(forward_kl_topk(s, t).item(), 6)  # e^-0.5 * 0.5 + e^-1.5 * 0.5
    0.41483
    >>> forward_kl_topk(t, s).item()  # the student above the teacher on both ids: negative, so 0
    0.0
    """
    teacher = teacher_topk.detach().to(torch.promote_types(teacher_topk.dtype, torch.float32))
    student = student_topk.to(teacher.dtype)
    if log_prob_min_clamp is not None:
        teacher, student = teacher.clamp_min(log_prob_min_clamp), student.clamp_min(log_prob_min_clamp)
    return (teacher.exp() * (teacher - student)).sum(-1).clamp_min(0.0)


def forward_kl_topk_loss(student_topk: torch.Tensor, teacher_topk: torch.Tensor, mask: torch.Tensor, mode: str,
                         normaliser: float | torch.Tensor | None = None, loss_max_clamp: float | None = None,
                         log_prob_min_clamp: float | None = None) -> torch.Tensor:
    """The top-k forward-KL distillation loss (before its coefficient): `forward_kl_topk`, clamped by
    `clamp_losses`, aggregated over the loss mask by actor.loss_agg_mode `mode`, as verl aggregates it."""
    losses = forward_kl_topk(student_topk, teacher_topk, log_prob_min_clamp)
    return agg_loss(clamp_losses(losses, loss_max_clamp), mask, mode, normaliser)


def topk_mass(topk: torch.Tensor) -> torch.Tensor:
    """(B, R, K) logprobs at the teacher's top-k ids -> (B, R) the probability they hold (verl's teacher_mass and
    student_mass).

    >>> round(topk_mass(torch.log(torch.tensor([[[0.5, 0.25]]]))).item(), 6)
    0.75
    """
    return topk.to(torch.promote_types(topk.dtype, torch.float32)).exp().sum(-1)


def discounted_future_sum(values: torch.Tensor, discount: float) -> torch.Tensor:
    """(B, R) -> (B, R): out[:, t] = sum_{k >= 0} discount^k * values[:, t + k] (0^0 = 1: discount 0 is `values`).

    >>> discounted_future_sum(torch.tensor([[1.0, 2.0, 4.0]]), 0.5).tolist()
    [[3.0, 4.0, 4.0]]
    """
    if discount == 0:
        return values.clone()
    out = torch.empty_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):  # R steps of (B,): one pass from the end
        running = values[:, t] + discount * running
        out[:, t] = running
    return out


def distill_advantages(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, discount: float = 0.0,
                       coef: float = 1.0, loss_max_clamp: float | None = None) -> torch.Tensor:
    """(B, R) per-token distillation advantages: coef * the discounted future sum of the per-token rewards
    -(log p_s - log p_t) over the loss mask (each k1 first clamped by `clamp_losses`, as verl clamps the losses it
    turns into advantages); 0 outside it. A teacher equal to the student gives 0 everywhere.

    >>> distill_advantages(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-0.5, -2.5]]), torch.ones(1, 2)).tolist()
    [[0.5, -0.5]]
    """
    rewards = zero_outside(-clamp_losses(student - teacher, loss_max_clamp), mask)
    return zero_outside(coef * discounted_future_sum(rewards, discount), mask)


def mixed_advantages(reward_advantages: torch.Tensor, distill: torch.Tensor | None, mask: torch.Tensor,
                     reward_weight: float) -> torch.Tensor:
    """The update's advantages: reward_weight * the reward's (B,) sequence advantages, plus (advantage mode) the (B, R)
    distillation advantages. (B,) without `distill` (the loss mode: the teacher acts through the loss), else (B, R).

    >>> mixed_advantages(torch.tensor([1.0]), torch.tensor([[0.5, -0.5]]), torch.ones(1, 2), 0.5).tolist()
    [[1.0, 0.0]]
    """
    weighted = reward_weight * reward_advantages
    if distill is None:
        return weighted
    return broadcast_to_tokens(weighted.to(distill.dtype), mask) + zero_outside(distill, mask)


def distill_metrics(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                    teacher_topk: torch.Tensor | None = None) -> dict[str, float]:
    """distill/reverse_kl (the k1 estimate, mean per token), distill/teacher_logprob and distill/student_logprob (mean
    logprob of the sampled tokens) over the mask's tokens (padding rows have none); with the teacher's (B, R, K)
    top-k logprobs also distill/teacher_topk_mass (the probability they hold, mean per token: verl's teacher_mass);
    0 without a token."""
    count = max(float((mask != 0).sum()), 1.0)

    def mean(values: torch.Tensor) -> float:
        return float(zero_outside(values.to(torch.float64), mask).sum()) / count

    out = {"distill/reverse_kl": mean(student - teacher), "distill/teacher_logprob": mean(teacher),
           "distill/student_logprob": mean(student)}
    if teacher_topk is not None:
        out["distill/teacher_topk_mass"] = mean(topk_mass(teacher_topk))
    return out
