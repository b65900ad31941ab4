"""Policy losses as per-token loss matrices: PPO-clip (with dual-clip), GSPO, CISPO and SAPO.

Shapes: B = rows, R = padded response length. Each loss takes
    logprobs (B, R)       current policy logprobs of the response tokens (carry the gradient),
    old_logprobs (B, R)   the policy that generated the data (no gradient),
    advantages (B, R)     token advantages (`broadcast_to_tokens` of the (B,) sequence advantages),
    response_mask (B, R)  1 on policy tokens,
    clip_ratio_low, clip_ratio_high, clip_ratio_c (and a loss's own knobs: SAPO's tau_pos, tau_neg)
and returns a `TokenLoss`: the (B, R) loss to multiply by any rollout-correction weight and reduce with
`aggregation.agg_loss`, plus diagnostics over THIS batch's real tokens.

Ratios are computed from log ratios clamped to [-20, 20] so that exp() cannot overflow on one wild token. Inputs are
zeroed under the mask's zeros first: a NaN or -inf logprob at a padded position changes neither the loss nor any
gradient (each such position gets exactly 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlmrl.algorithms.aggregation import masked_row_sum, token_mean, zero_outside
from vlmrl.algorithms.config import POLICY_LOSSES  # noqa: F401 - re-exported beside the losses it names

LOG_RATIO_BOUND = 20.0
"""|log ratio| is clamped to this before exp() wherever a ratio of probabilities is formed (policy losses, rollout
correction's weights, the low_var_kl penalty): exp(20) ~ 5e8 keeps the ratio finite in float32 (verl clamps at 20
too). Rollout correction's rejection tests compare the unclamped log ratio with the band's logs instead (no exp() to
keep finite; a clamp per token would let extreme tokens cancel: `vlmrl.algorithms.correction`), as TRL does and verl
does not."""


@dataclass
class TokenLoss:
    """A per-token policy loss and its diagnostics (each a detached scalar over this batch's real tokens)."""

    loss_mat: torch.Tensor
    """(B, R) per-token loss; values under the mask's zeros are meaningless (agg_loss ignores them)."""
    metrics: dict[str, torch.Tensor]
    """clipfrac_low / clipfrac_high: fraction of tokens whose ratio was clipped at the lower / upper bound of the trust
    region (the side that binds for a negative / positive advantage); dual_clip_fraction: negative-advantage tokens
    whose loss was capped at clip_ratio_c * |A|; ratio_mean / ratio_min / ratio_max: the (sequence-level for GSPO)
    importance ratio, min/max being +inf/-inf when the batch has no real token (the identities of min and max, so
    micro-batches combine exactly); approx_kl: token mean of old - new logprob."""


def _ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """ratio_mean / _min / _max and approx_kl over the real tokens of (B, R) ratio / log_ratio."""
    keep = mask != 0
    ratio = ratio.detach()
    inf = torch.tensor(math.inf, dtype=ratio.dtype, device=ratio.device)
    return {
        "ratio_mean": token_mean(ratio, mask),
        "ratio_min": torch.where(keep, ratio, inf).min() if ratio.numel() else inf,
        "ratio_max": torch.where(keep, ratio, -inf).max() if ratio.numel() else -inf,
        "approx_kl": token_mean(-log_ratio.detach(), mask),
    }


def _check_dual_clip(clip_ratio_c: float | None) -> None:
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip) must be > 1, got {clip_ratio_c}; None turns dual-clip off")


def _clipped_objective(ratio: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor,
                       response_mask: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float,
                       clip_ratio_c: float | None) -> TokenLoss:
    """max(-A r, -A clip(r, 1 - low, 1 + high)), capped at -A c where A < 0 (dual-clip)."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clip_binds = clipped > unclipped
        metrics = {
            "clipfrac_low": token_mean((clip_binds & (advantages < 0)).float(), response_mask),
            "clipfrac_high": token_mean((clip_binds & (advantages > 0)).float(), response_mask),
        }
    if clip_ratio_c is None:
        metrics["dual_clip_fraction"] = torch.zeros_like(metrics["clipfrac_low"])
    else:
        cap = -advantages * clip_ratio_c
        negative = advantages < 0
        with torch.no_grad():
            metrics["dual_clip_fraction"] = token_mean((negative & (loss > cap)).float(), response_mask)
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    metrics.update(_ratio_metrics(ratio, log_ratio, response_mask))
    return TokenLoss(loss, metrics)


def ppo_clip_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                        clip_ratio_c: float | None = 3.0) -> TokenLoss:
    """PPO-clip with dual-clip (Ye et al. 2019, arXiv:1912.09729; verl's clip_ratio_c, EasyR1's clip_ratio_dual):

        l_t = max(-A_t r_t, -A_t clip(r_t, 1 - low, 1 + high)),   r_t = exp(logprobs_t - old_logprobs_t)
        l_t = min(l_t, -A_t * clip_ratio_c)   where A_t < 0

    The cap bounds what one negative-advantage token with a huge ratio can contribute (e^20 * |A| otherwise) and
    gives it no gradient. clip_ratio_high > clip_ratio_low is DAPO's clip-higher. clip_ratio_c None = no dual-clip.

    >>> ppo_clip_token_loss(torch.tensor([[2.0]]), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1)).loss_mat
    tensor([[3.]])
    """
    _check_dual_clip(clip_ratio_c)
    logprobs, old_logprobs, advantages = (zero_outside(x, response_mask) for x in (logprobs, old_logprobs, advantages))
    log_ratio = torch.clamp(logprobs - old_logprobs.detach(), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return _clipped_objective(torch.exp(log_ratio), log_ratio, advantages, response_mask, clip_ratio_low,
                              clip_ratio_high, clip_ratio_c)


def gspo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4,
                    clip_ratio_c: float | None = 3.0) -> TokenLoss:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071), its token form GSPO-token with stop-gradient (verl's
    compute_policy_loss_gspo, EasyR1's gspo_token):

        s_i = exp(mean over real tokens t of sequence i of (logprobs_it - old_logprobs_it))
        s_it = sg[s_i] * exp(logprobs_it - sg[logprobs_it])     (value s_i; gradient of logprobs_it times s_i)

    then the clipped objective of `ppo_clip_token_loss` with s_it as the ratio. Its clip range is far narrower than
    PPO's because a sequence's geometric-mean ratio moves far less than a token's: the paper uses 3e-4 / 4e-4.
    Dual-clip applies as in PPO-clip (as in EasyR1; verl's GSPO has none). The paper aggregates with
    seq-mean-token-mean. A row without real tokens gets ratio 1.
    """
    _check_dual_clip(clip_ratio_c)
    logprobs, old_logprobs, advantages = (zero_outside(x, response_mask) for x in (logprobs, old_logprobs, advantages))
    keep = response_mask != 0
    diff = logprobs.detach() - old_logprobs.detach()
    tokens = keep.sum(dim=-1, keepdim=True)
    seq_log_ratio = masked_row_sum(diff, keep) / tokens.clamp(min=1).to(diff.dtype)  # (B, 1)
    seq_log_ratio = torch.clamp(seq_log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    log_ratio = seq_log_ratio + logprobs - logprobs.detach()
    ratio = torch.exp(log_ratio)
    token_log_ratio = torch.clamp(diff, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    out = _clipped_objective(ratio, log_ratio, advantages, response_mask, clip_ratio_low, clip_ratio_high,
                             clip_ratio_c)
    out.metrics["approx_kl"] = token_mean(-token_log_ratio, response_mask)  # the token-level drift, as for PPO
    return out


def cispo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                     response_mask: torch.Tensor, clip_ratio_low: float = 1.0, clip_ratio_high: float = 0.2,
                     clip_ratio_c: float | None = 3.0) -> TokenLoss:
    """CISPO (MiniMax-M1, arXiv:2506.13585; verl's compute_policy_loss_cispo):

        l_t = -sg[clip(r_t, 1 - low, 1 + high)] * A_t * logprobs_t

    The importance weight is clipped and detached, so EVERY token keeps a gradient (REINFORCE weighted by the
    clipped weight) instead of being dropped as PPO's clip drops it. The paper bounds only the top: the default
    low = 1.0 puts the floor at 0 (verl's example uses low = 10, which is the same). clipfrac_low / clipfrac_high
    count tokens whose weight was clipped at either bound whatever the advantage's sign. clip_ratio_c has no effect
    (the weight is already capped at 1 + high); it is accepted so every loss takes the same call.
    """
    logprobs, old_logprobs, advantages = (zero_outside(x, response_mask) for x in (logprobs, old_logprobs, advantages))
    log_ratio = torch.clamp(logprobs.detach() - old_logprobs.detach(), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = -weight * advantages * logprobs
    metrics = {
        "clipfrac_low": token_mean((ratio < 1.0 - clip_ratio_low).float(), response_mask),
        "clipfrac_high": token_mean((ratio > 1.0 + clip_ratio_high).float(), response_mask),
        "dual_clip_fraction": torch.zeros((), dtype=ratio.dtype, device=ratio.device),
    }
    metrics.update(_ratio_metrics(ratio, log_ratio, response_mask))
    return TokenLoss(loss, metrics)


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
    """SAPO's soft gate f(r) = 4 / tau * sigmoid(tau * (r - 1)): the surrogate that replaces PPO's clipped ratio.

    Its slope f'(r) = 4 sigmoid(x) (1 - sigmoid(x)), x = tau (r - 1), is 1 at r = 1 for every tau (the plain policy
    gradient on policy) and decays smoothly on both sides, faster the larger tau.

    >>> [round(v, 4) for v in sapo_gate(torch.tensor([0.5, 1.0, 2.0]), 1.0).tolist()]
    [1.5102, 2.0, 2.9242]
    """
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                    clip_ratio_c: float | None = 3.0, tau_pos: float = 1.0, tau_neg: float = 1.05) -> TokenLoss:
    """SAPO, soft adaptive policy optimisation (Gao et al. 2025, arXiv:2511.20347; EasyR1's loss_type="sapo", verl's
    compute_policy_loss_sapo, TRL's loss_type="sapo"):

        l_t = -A_t * 4 / tau_t * sigmoid(tau_t * (r_t - 1)),   r_t = exp(logprobs_t - old_logprobs_t)
        tau_t = tau_pos where A_t > 0, else tau_neg

    No hard clip: a token's gradient is A_t r_t times the gate's slope (1 at r = 1), which fades smoothly as r_t
    leaves 1, so an off-policy token is attenuated instead of cut off. tau_neg > tau_pos (the paper's 1.05 vs 1.0)
    fades negative-advantage tokens faster: their gradient raises many other tokens' probabilities at once and is
    the less stable side. clip_ratio_low / high / c have no effect (accepted so every loss takes the same call);
    clipfrac_low / clipfrac_high / dual_clip_fraction are 0 (verl reports 0 too). The paper, verl and TRL aggregate
    with seq-mean-token-mean, EasyR1 with its loss_avg_mode (token by default); here actor.loss_agg_mode decides.

    >>> sapo_token_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)).loss_mat
    tensor([[-2.0000,  1.9048]])
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"SAPO's temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    logprobs, old_logprobs, advantages = (zero_outside(x, response_mask) for x in (logprobs, old_logprobs, advantages))
    log_ratio = torch.clamp(logprobs - old_logprobs.detach(), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    loss = -advantages * sapo_gate(ratio, tau)
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    metrics = {"clipfrac_low": zero, "clipfrac_high": zero, "dual_clip_fraction": zero}
    metrics.update(_ratio_metrics(ratio, log_ratio, response_mask))
    return TokenLoss(loss, metrics)


PolicyLossFn = Callable[..., TokenLoss]

POLICY_LOSS_FNS: dict[str, PolicyLossFn] = {
    "ppo-clip": ppo_clip_token_loss,
    "gspo": gspo_token_loss,
    "cispo": cispo_token_loss,
    "sapo": sapo_token_loss,
}
"""name -> loss; each is called as fn(logprobs, old_logprobs, advantages, response_mask, clip_ratio_low=...,
clip_ratio_high=..., clip_ratio_c=..., plus its own knobs: `ActorConfig.policy_loss_kwargs` gives them all)."""

