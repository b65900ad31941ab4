"""Rollout correction: the engine that sampled a response (vLLM/SGLang, bf16 kernels, its own sampler) does not
assign exactly the trainer's logprobs, so the "on-policy" data is slightly off-policy. These corrections reweight or
drop tokens by the trainer/engine ratio exp(old_logprobs - rollout_logprobs).

Shapes: B = rows, R = padded response length; rho_t = exp(old_t - rollout_t) is a token's ratio, rho = prod_t rho_t a
sequence's. Modes (ROLLOUT_CORRECTIONS): off; token_tis (weight min(rho_t, token_cap): verl's Token-TIS, TRL's
token_truncate); token_icepop (weight rho_t inside [token_low, token_high], 0 outside: verl's decoupled_token_icepop,
TRL's token_mask); seq_mis (a sequence whose rho leaves [seq_low, seq_high] is masked out, a kept one weighted by rho:
verl's Seq-MIS preset, TRL's sequence_mask); seq_rs (the same rejection with weight 1; seq_ratio="geometric" is verl's
Geo-RS); bypass (no weights here: the fit loop makes the engine's logprobs the update's old logprobs, verl's bypass
mode, so the PPO ratio pi_theta / pi_rollout is clipped directly). Bands are inclusive and bound the ratio itself, as verl's rollout_corr_math.md and TRL do (verl's code bounds
1 / rho: the same for symmetric bands). Compared in log space, so no exp() overflows on a long sequence. The band
test takes a sequence's true log ratio, its tokens' log ratios summed unclamped (as TRL's sequence_mask does): verl
clamps each token's log ratio to +-20 first, so two extreme tokens can cancel (log ratios [25, -21]: rho = e^4, far
outside [0.5, 2], which verl keeps with its weight capped at 2); a rejection test is there to catch such a sequence,
and with no exp() in it there is nothing the clamp would keep finite. Weights are formed from clamped logs
(LOG_RATIO_BOUND). Apply:
multiply the policy loss matrix by `weights` and aggregate with `mask`. In full: docs/algorithms.md, "Rollout
correction".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vlmrl.algorithms.aggregation import masked_row_sum, token_mean
from vlmrl.algorithms.config import ROLLOUT_CORRECTIONS, SEQ_RATIOS
from vlmrl.algorithms.policy_loss import LOG_RATIO_BOUND


@dataclass
class RolloutCorrection:
    weights: torch.Tensor
    """(B, R) detached per-token weight, 0 under the returned mask's zeros."""
    mask: torch.Tensor
    """(B, R) the loss mask after correction (same dtype as the input mask)."""
    metrics: dict[str, float]
    """weight_mean / weight_max over the input mask's tokens, truncated_fraction (tokens whose weight hit token_cap),
    zeroed_token_fraction (token_icepop: tokens whose weight was set to 0, left in the mask), masked_seq_fraction
    (real sequences taken out), masked_token_fraction (tokens taken out)."""


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "off",
    token_cap: float = 2.0,
    seq_low: float = 0.5,
    seq_high: float = 2.0,
    seq_ratio: str = "product",
    token_low: float = 0.5,
    token_high: float = 5.0,
) -> RolloutCorrection:
    """Importance weights and mask for the trainer/engine logprob gap (see the module docstring).

    Args:
        old_logprobs: (B, R) the trainer's logprobs of the sampled tokens before the update.
        rollout_logprobs: (B, R) the engine's logprobs of the same tokens.
        response_mask: (B, R) 1 on policy tokens.
        mode: one of ROLLOUT_CORRECTIONS.
        token_cap: token_tis's upper bound on a weight (> 0).
        seq_low, seq_high: seq_mis's and seq_rs's band for the sequence ratio (0 < low <= 1 <= high).
        seq_ratio: "product" or "geometric" (seq_rs; seq_mis weighs by the product, so it takes "product" only).
        token_low, token_high: token_icepop's band for a token's ratio (0 < low <= 1 <= high; IcePop's 0.5 and 5).

    >>> old = torch.tensor([[-2.0, -2.0], [-2.0, -2.0]]); mask = torch.ones(2, 2)
    >>> rollout_correction(old, torch.tensor([[-3.0, -2.0], [-2.0, -1.0]]), mask, "token_tis").weights
    tensor([[2.0000, 1.0000],
            [1.0000, 0.3679]])
    >>> out = rollout_correction(old, torch.tensor([[-3.0, -2.0], [-2.3, -2.1]]), mask, "seq_mis")
    >>> out.mask, out.weights  # row 0: e^1 > 2 leaves the band; row 1: e^0.4 = 1.4918 is its weight
    (tensor([[0., 0.],
            [1., 1.]]), tensor([[0.0000, 0.0000],
            [1.4918, 1.4918]]))
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; choose one of {ROLLOUT_CORRECTIONS}")
    if seq_ratio not in SEQ_RATIOS:
        raise ValueError(f"unknown seq_ratio {seq_ratio!r}; choose one of {SEQ_RATIOS}")
    if mode == "seq_mis" and seq_ratio != "product":
        raise ValueError("seq_mis weighs a sequence by the product of its token ratios; for a band on their "
                         "geometric mean (Geo-RS) use mode seq_rs")
    if not token_cap > 0 or not 0 < seq_low <= 1.0 <= seq_high or not 0 < token_low <= 1.0 <= token_high:
        raise ValueError(f"need token_cap > 0, 0 < seq_low <= 1 <= seq_high and 0 < token_low <= 1 <= token_high; "
                         f"got {token_cap}, {seq_low}, {seq_high}, {token_low}, {token_high}")
    keep = response_mask != 0
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old_logprobs.device)
    log_ratio = torch.where(keep, old_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype), zero)
    ones = torch.where(keep, torch.ones((), dtype=dtype, device=old_logprobs.device), zero)
    weights, mask = ones, response_mask
    truncated = zeroed = torch.zeros_like(keep)
    real_rows = keep.any(dim=-1)
    dropped = torch.zeros_like(real_rows)
    if mode in ("token_tis", "token_icepop"):
        ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        if mode == "token_tis":
            truncated = keep & (ratio > token_cap)
            weights = torch.where(keep, torch.clamp(ratio, max=token_cap), zero)
        else:
            zeroed = keep & ((log_ratio < math.log(token_low)) | (log_ratio > math.log(token_high)))
            weights = torch.where(keep & ~zeroed, ratio, zero)
    elif mode in ("seq_mis", "seq_rs"):
        seq_log = masked_row_sum(log_ratio, keep).squeeze(-1)  # (B,) log of the product of the token ratios
        if seq_ratio == "geometric":
            seq_log = seq_log / keep.sum(dim=-1).clamp(min=1).to(dtype)
        dropped = real_rows & ((seq_log < math.log(seq_low)) | (seq_log > math.log(seq_high)))
        mask = torch.where(dropped.unsqueeze(-1), torch.zeros_like(response_mask), response_mask)
        # Seq-MIS weighs a kept row by its rho (inside the band: the clamp only keeps exp() of a dropped row finite)
        row_weight = torch.exp(torch.clamp(seq_log, max=math.log(seq_high))) if mode == "seq_mis" else 1.0
        weights = torch.where(dropped.unsqueeze(-1), zero, ones * torch.as_tensor(row_weight).reshape(-1, 1))
    tokens = int(keep.sum())
    sequences = int(real_rows.sum())
    metrics = {
        "weight_mean": float(token_mean(weights, response_mask)),
        "weight_max": float(torch.where(keep, weights, zero).max()) if tokens else 0.0,
        "truncated_fraction": float(truncated.sum()) / tokens if tokens else 0.0,
        "zeroed_token_fraction": float(zeroed.sum()) / tokens if tokens else 0.0,
        "masked_seq_fraction": float(dropped.sum()) / sequences if sequences else 0.0,
        "masked_token_fraction": float((keep & dropped.unsqueeze(-1)).sum()) / tokens if tokens else 0.0,
    }
    return RolloutCorrection(weights, mask, metrics)
