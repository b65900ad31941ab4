"""GRPO math: group-normalised advantages, the PPO-clip token-mean loss, KL estimators and entropy.

Pure functions over tensors: no config objects, no process groups, no device assumptions.
Shapes: B = rows in the batch (rollout.n samples per prompt, plus padding rows), R = padded response length, V = vocab.

Token-mean everywhere means: the sum over every real response token of the mini-batch, divided by the number of those
tokens. A micro-batch passes the mini-batch's token count as `num_tokens`, so summing micro-batch losses gives exactly
the mini-batch's token mean whatever the micro-batch split (1 x 8 == 8 x 1).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlmrl.algorithms.config import KL_TYPES


def group_advantages(
    rewards: torch.Tensor,
    uids: Sequence[str],
    is_padding: torch.Tensor | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO outcome advantages: each sample's reward minus its group's mean, divided by the group's std (optional).

    Args:
        rewards: (B,) float, one sequence-level reward per row.
        uids: B group ids; rows with the same uid were sampled from the same prompt.
        is_padding: (B,) bool; padding rows get advantage 0 and never enter any group's statistics.
        norm_by_std: divide by the group std (GRPO); False gives Dr. GRPO-style mean-centred advantages.
        eps: added to the std so that a group with equal rewards gets 0, not NaN.

    Returns:
        (B,) float advantages. A group of one real sample gets 0: with nothing to compare against it carries no signal.

    >>> [round(a, 4) for a in group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), ["a", "a", "b", "b"]).tolist()]
    [0.7071, -0.7071, 0.0, 0.0]
    """
    if rewards.dim() != 1 or rewards.shape[0] != len(uids):
        raise ValueError(f"rewards must be (B,) with B == len(uids); got {tuple(rewards.shape)} and {len(uids)} uids")
    padding = torch.zeros_like(rewards, dtype=torch.bool) if is_padding is None else is_padding.to(torch.bool)
    groups: dict[str, list[int]] = defaultdict(list)
    for row, uid in enumerate(uids):
        if not padding[row]:
            groups[uid].append(row)
    scores = rewards.detach().to(torch.float32)
    advantages = torch.zeros_like(scores)
    for rows in groups.values():
        if len(rows) < 2:
            continue
        index = torch.tensor(rows)
        group = scores[index]
        centred = group - group.mean()
        advantages[index] = centred / (group.std() + eps) if norm_by_std else centred
    return advantages


def broadcast_to_tokens(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence advantages -> (B, R) token advantages, 0 where response_mask is 0."""
    return advantages.unsqueeze(-1) * response_mask


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where mask is 1 (any shape, same for both). Returns a scalar."""
    return (values * mask).sum()


def token_mean(values: torch.Tensor, mask: torch.Tensor,
               num_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """Sum over masked tokens / num_tokens (default: this mask's token count). Returns a scalar; 0 when no tokens.

    Args:
        values: (B, R).
        mask: (B, R), 1 on tokens that count.
        num_tokens: the token count to divide by; pass the whole mini-batch's count from a micro-batch.
    """
    denominator = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=values.dtype)
    return masked_sum(values, mask) / torch.clamp(denominator, min=1.0)


@dataclass
class PolicyLoss:
    """The PPO-clip loss of one (micro-)batch and its diagnostics (diagnostics are token means over THIS batch)."""

    loss: torch.Tensor
    """Scalar: sum of clipped token losses / num_tokens."""
    clip_fraction: torch.Tensor
    """Scalar: fraction of tokens where the clipped objective was the active one."""
    approx_kl: torch.Tensor
    """Scalar: token mean of old_logprobs - logprobs (how far the policy moved since the rollout)."""


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    num_tokens: float | torch.Tensor | None = None,
) -> PolicyLoss:
    """PPO-clip policy loss, token-mean aggregated.

    loss_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - low, 1 + high)),  r_t = exp(logprobs_t - old_logprobs_t).

    Args:
        logprobs: (B, R) current policy logprobs of the response tokens (carry the gradient).
        old_logprobs: (B, R) logprobs of the policy that generated the data (no gradient).
        advantages: (B, R) token advantages.
        response_mask: (B, R) float, 1 on policy tokens.
        clip_ratio_low, clip_ratio_high: the trust region (0.2 / 0.2 is standard PPO; a larger high is DAPO's
            clip-higher).
        num_tokens: see `token_mean`.

    >>> lp = torch.zeros(1, 2); out = ppo_clip_loss(lp, lp, torch.ones(1, 2), torch.ones(1, 2))
    >>> out.loss.item(), out.clip_fraction.item()
    (-1.0, 0.0)
    """
    log_ratio = torch.clamp(logprobs - old_logprobs.detach(), -20.0, 20.0)  # exp() must not overflow on a wild token
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    token_loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clip_fraction = token_mean((clipped > unclipped).float(), response_mask)
        approx_kl = token_mean(-log_ratio, response_mask)
    return PolicyLoss(token_mean(token_loss, response_mask, num_tokens), clip_fraction, approx_kl)


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
        log_ratio = torch.clamp(-diff, -20.0, 20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL type {kind!r}; choose one of {KL_TYPES}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: (..., V) -> (...). Computed stably as logsumexp - E[logit].

    >>> round(entropy_from_logits(torch.zeros(4)).item(), 6) == round(float(torch.log(torch.tensor(4.0))), 6)
    True
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Logprob of each label under softmax(logits): (..., V), (...) long -> (...). Raw distribution (no temperature)."""
    logits = logits.float()
    return torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
