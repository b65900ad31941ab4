"""Rollout correction: the engine that sampled a response (vLLM/SGLang, bf16 kernels, its own sampler) does not
assign exactly the trainer's logprobs, so the "on-policy" data is slightly off-policy. These corrections reweight or
drop tokens by the trainer/engine ratio exp(old_logprobs - rollout_logprobs).

Shapes: B = rows, R = padded response length. Modes (ROLLOUT_CORRECTIONS): off; token_tis (per-token weight
min(ratio, token_cap), detached: verl's rollout_is="token"); seq_mis (a sequence whose ratio, the product of its token
ratios or their geometric mean, leaves [seq_low, seq_high] is masked out: verl's Seq-MIS / Geo-RS), compared in log
space so no exp() overflows on a long sequence. Apply: multiply the policy loss matrix by `weights` and aggregate with
`mask` (normaliser from the corrected mask), so a masked sequence drops out of every mode's counts. When to turn it
on, and each mode in full: docs/algorithms.md, "Rollout correction"."""

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
    masked_seq_fraction (real sequences taken out), masked_token_fraction (tokens taken out)."""


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "off",
    token_cap: float = 2.0,
    seq_low: float = 0.5,
    seq_high: float = 2.0,
    seq_ratio: str = "product",
) -> RolloutCorrection:
    """Importance weights and mask for the trainer/engine logprob gap (see the module docstring).

    Args:
        old_logprobs: (B, R) the trainer's logprobs of the sampled tokens before the update.
        rollout_logprobs: (B, R) the engine's logprobs of the same tokens.
        response_mask: (B, R) 1 on policy tokens.
        mode: one of ROLLOUT_CORRECTIONS.
        token_cap: token_tis's upper bound on a weight (> 0).
        seq_low, seq_high: seq_mis's band for the sequence ratio (0 < low <= 1 <= high).
        seq_ratio: "product" or "geometric" (seq_mis).

    >>> old = torch.tensor([[-2.0, -2.0], [-2.0, -2.0]]); mask = torch.ones(2, 2)
    >>> rollout_correction(old, torch.tensor([[-3.0, -2.0], [-2.0, -1.0]]), mask, "token_tis").weights
    tensor([[2.0000, 1.0000],
            [1.0000, 0.3679]])
    >>> rollout_correction(old, torch.tensor([[-3.0, -2.0], [-2.5, -2.0]]), mask, "seq_mis").mask
    tensor([[0., 0.],
            [1., 1.]])
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; choose one of {ROLLOUT_CORRECTIONS}")
    if seq_ratio not in SEQ_RATIOS:
        raise ValueError(f"unknown seq_ratio {seq_ratio!r}; choose one of {SEQ_RATIOS}")
    if not token_cap > 0 or not 0 < seq_low <= 1.0 <= seq_high:
        raise ValueError(f"need token_cap > 0 and 0 < seq_low <= 1 <= seq_high; got {token_cap}, {seq_low}, "
                         f"{seq_high}")
    keep = response_mask != 0
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old_logprobs.device)
    log_ratio = torch.where(keep, old_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype), zero)
    ones = torch.where(keep, torch.ones((), dtype=dtype, device=old_logprobs.device), zero)
    weights, mask = ones, response_mask
    truncated = torch.zeros_like(keep)
    real_rows = keep.any(dim=-1)
    dropped = torch.zeros_like(real_rows)
    if mode == "token_tis":
        ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        truncated = keep & (ratio > token_cap)
        weights = torch.where(keep, torch.clamp(ratio, max=token_cap), zero)
    elif mode == "seq_mis":
        seq_log = masked_row_sum(log_ratio, keep).squeeze(-1)  # (B,)
        if seq_ratio == "geometric":
            seq_log = seq_log / keep.sum(dim=-1).clamp(min=1).to(dtype)
        dropped = real_rows & ((seq_log < math.log(seq_low)) | (seq_log > math.log(seq_high)))
        mask = torch.where(dropped.unsqueeze(-1), torch.zeros_like(response_mask), response_mask)
        weights = torch.where(dropped.unsqueeze(-1), zero, ones)
    tokens = int(keep.sum())
    sequences = int(real_rows.sum())
    metrics = {
        "weight_mean": float(token_mean(weights, response_mask)),
        "weight_max": float(torch.where(keep, weights, zero).max()) if tokens else 0.0,
        "truncated_fraction": float(truncated.sum()) / tokens if tokens else 0.0,
        "masked_seq_fraction": float(dropped.sum()) / sequences if sequences else 0.0,
        "masked_token_fraction": float((keep & dropped.unsqueeze(-1)).sum()) / tokens if tokens else 0.0,
    }
    return RolloutCorrection(weights, mask, metrics)
