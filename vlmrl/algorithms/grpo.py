"""GRPO math: the PPO-clip token-mean loss, KL estimators and entropy (advantages live in `advantages`, the loss
modes in `aggregation`, the other policy losses in `policy_loss`; their GRPO names are re-exported here).

Pure functions over tensors: no config objects, no process groups, no device assumptions.
Shapes: B = rows in the batch (rollout.n samples per prompt, plus padding rows), R = padded response length, V = vocab.

Token-mean everywhere means: the sum over every real response token of the mini-batch, divided by the number of those
tokens. A micro-batch passes the mini-batch's token count as `num_tokens`, so summing micro-batch losses gives exactly
the mini-batch's token mean whatever the micro-batch split (1 x 8 == 8 x 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmrl.algorithms.advantages import group_advantages
from vlmrl.algorithms.aggregation import masked_sum, token_mean
from vlmrl.algorithms.config import KL_TYPES
from vlmrl.algorithms.policy_loss import LOG_RATIO_BOUND, ppo_clip_token_loss

__all__ = [
    "KL_TYPES", "PolicyLoss", "broadcast_to_tokens", "entropy_from_logits", "group_advantages", "kl_penalty",
    "logprobs_from_logits", "masked_sum", "ppo_clip_loss", "token_mean",
]


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence advantages -> (B, R) token advantages (the advantages' dtype), 0 where response_mask is 0.
    (B, R) per-token advantages (on-policy distillation's) are taken as they are, 0 where response_mask is 0."""
    values = advantages.unsqueeze(-1).expand(response_mask.shape) if advantages.dim() == 1 else advantages
    return torch.where(response_mask != 0, values, torch.zeros((), dtype=advantages.dtype, device=advantages.device))


@dataclass
class PolicyLoss:
    """The PPO-clip loss of one (micro-)batch and its diagnostics (diagnostics are token means over THIS batch)."""

    loss: torch.Tensor
    """Scalar: sum of clipped token losses / num_tokens."""
    clip_fraction: torch.Tensor
    """Scalar: fraction of tokens where the trust-region clip was the active one (either side)."""
    approx_kl: torch.Tensor
    """Scalar: token mean of old_logprobs - logprobs (how far the policy moved since the rollout)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """All of `TokenLoss.metrics`: clipfrac_low / clipfrac_high, dual_clip_fraction, ratio_mean / _min / _max."""


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    num_tokens: float | torch.Tensor | None = None,
    clip_ratio_c: float | None = 3.0,
) -> PolicyLoss:
    """PPO-clip policy loss with dual-clip, token-mean aggregated (`policy_loss.ppo_clip_token_loss` + `token_mean`).

    loss_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - low, 1 + high)),  r_t = exp(logprobs_t - old_logprobs_t);
    where A_t < 0 the loss is capped at -A_t * clip_ratio_c (verl / EasyR1 default 3).

    Args:
        logprobs: (B, R) current policy logprobs of the response tokens (carry the gradient).
        old_logprobs: (B, R) logprobs of the policy that generated the data (no gradient).
        advantages: (B, R) token advantages.
        response_mask: (B, R) float, 1 on policy tokens.
        clip_ratio_low, clip_ratio_high: the trust region (0.2 / 0.2 is standard PPO; a larger high is DAPO's
            clip-higher).
        num_tokens: see `token_mean`.
        clip_ratio_c: the dual-clip cap (> 1); None turns it off.

    >>> lp = torch.zeros(1, 2); out = ppo_clip_loss(lp, lp, torch.ones(1, 2), torch.ones(1, 2))
    >>> out.loss.item(), out.clip_fraction.item()
    (-1.0, 0.0)
    >>> ppo_clip_loss(torch.tensor([[2.0]]), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1)).loss.item()
    3.0
    """
    out = ppo_clip_token_loss(logprobs, old_logprobs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
                              clip_ratio_c)
    clip_fraction = out.metrics["clipfrac_low"] + out.metrics["clipfrac_high"]  # disjoint: A < 0 vs A > 0
    return PolicyLoss(token_mean(out.loss_mat, response_mask, num_tokens), clip_fraction, out.metrics["approx_kl"],
                      out.metrics)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token logprobs (Schulman's k1/k2/k3).

    Args:
        logprobs: (B, R) current policy (carries the gradient).
        ref_logprobs: (B, R) frozen reference.
        kind: `low_var_kl` (k3: exp(ref - lp) - (ref - lp) - 1, non-negative, clamped to [-10, 10] like verl),
            `k1` (lp - ref), `k2` / `mse` (0.5 * (lp - ref)^2).

    Returns:
        (B, R) per-token KL; aggregate it with `token_mean`.

    >>> kl_penalty(torch.tensor([[0.0]]), torch.tensor([[0.0]])).item()
    0.0
    """
    diff = logprobs - ref_logprobs.detach()
    if kind == "k1":
        return diff
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    if kind == "low_var_kl":
        log_ratio = torch.clamp(-diff, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL type {kind!r}; choose one of {KL_TYPES}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: (..., V) -> (...). Computed stably as logsumexp - E[logit].

    >>> round(entropy_from_logits(torch.zeros(4)).item(), 6) == round(float(torch.log(torch.tensor(4.0))), 6)
    True
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least float32, never cast down
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Logprob of each label under softmax(logits): (..., V), (...) long -> (...). Raw distribution (no temperature)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least float32, never cast down
    return torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
