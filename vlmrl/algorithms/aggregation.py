"""Masked sums and the loss-aggregation modes: how a (B, R) per-token loss becomes the scalar that is back-propagated.

Shapes: B = rows, R = padded response length. A mask is 0/1 (float or bool); only where it is non-zero does a value
count, and a NaN or inf where it is 0 never reaches the result (selected with torch.where, not multiplied by 0).

Every mode is a SUM of per-row contributions divided by one normaliser, so it splits exactly:

    mode                      row i contributes                    normaliser (of the whole mini-batch)
    token-mean                sum_t l_it                           real tokens
    seq-mean-token-sum        sum_t l_it                           real sequences (rows with >= 1 token)
    seq-mean-token-mean       sum_t l_it / n_i                     real sequences
    seq-mean-token-sum-norm   sum_t l_it                           real sequences * max_response_length (Dr. GRPO)

A caller that splits a mini-batch into micro-batches passes every micro-batch the mini-batch's `loss_normaliser`;
the micro-batch losses then sum to the mini-batch loss (1 x 8 == 8 x 1). A data-parallel rank passes that global
normaliser divided by the world size; the ranks' AVERAGED gradient is then the global mini-batch's (dp=1 == dp=N).
"""

from __future__ import annotations

import torch

from vlmrl.algorithms.config import LOSS_AGG_MODES


def zero_outside(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` where mask is non-zero, exactly 0 elsewhere (a NaN/inf there is dropped, and so is its gradient:
    torch.where sends a zero gradient to the branch it did not select)."""
    return torch.where(mask != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where mask is non-zero (same shape). Returns a scalar; NaN/inf under the mask's zeros ignored.

    >>> masked_sum(torch.tensor([1.0, float("nan"), float("inf")]), torch.tensor([1.0, 0.0, 0.0])).item()
    1.0
    """
    return zero_outside(values, mask).sum()


def masked_row_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) -> (B, 1): each row's sum where mask is non-zero (NaN/inf under the zeros ignored)."""
    return zero_outside(values, mask).sum(dim=-1, keepdim=True)


def _divide(total: torch.Tensor, normaliser: float | torch.Tensor) -> torch.Tensor:
    """total / normaliser; a zero normaliser (nothing to average over) gives 0. Any other value is used as given:
    a sharded rank divides by global_count / world_size, which can be below 1."""
    normaliser = torch.as_tensor(normaliser, dtype=total.dtype, device=total.device)
    return total / torch.where(normaliser == 0, torch.ones_like(normaliser), normaliser)


def token_mean(values: torch.Tensor, mask: torch.Tensor,
               num_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """Sum over masked tokens / num_tokens (default: this mask's token count). Returns a scalar; 0 when no tokens.

    Args:
        values: (B, R).
        mask: (B, R), 1 on tokens that count.
        num_tokens: the token count to divide by; pass the whole mini-batch's count from a micro-batch (or that
            count / world size from a sharded rank). Only 0 is special (gives 0); nothing is clamped.

    >>> token_mean(torch.tensor([[2.0, 4.0]]), torch.tensor([[1.0, 1.0]]), num_tokens=0.5).item()
    12.0
    """
    return _divide(masked_sum(values, mask), (mask != 0).sum() if num_tokens is None else num_tokens)


def loss_normaliser(mask: torch.Tensor, mode: str = "token-mean", max_response_length: int | None = None
                    ) -> torch.Tensor:
    """The normaliser of `agg_loss` for the batch `mask` covers: compute it ONCE over the whole mini-batch.

    Args:
        mask: (B, R) loss mask of the whole mini-batch (after any masking of sequences or truncated responses;
            padding rows have an all-zero mask and so count for nothing).
        mode: one of LOSS_AGG_MODES.
        max_response_length: the run's constant response budget (data.max_response_length), for
            seq-mean-token-sum-norm; None = R, which is constant only if every batch is padded to the same width.

    Returns:
        scalar float64: real tokens (token-mean), real sequences (seq-mean-token-sum / -mean), or real sequences *
        max_response_length (seq-mean-token-sum-norm). A rank of an N-way sharded run divides it by N.

    >>> mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    >>> [loss_normaliser(mask, m, 4).item() for m in LOSS_AGG_MODES]
    [3.0, 2.0, 2.0, 8.0]
    """
    keep = mask != 0
    if mode == "token-mean":
        return keep.sum().to(torch.float64)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {LOSS_AGG_MODES}")
    sequences = keep.any(dim=-1).sum().to(torch.float64)
    if mode == "seq-mean-token-sum-norm":
        return sequences * (mask.shape[-1] if max_response_length is None else max_response_length)
    return sequences


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
             normaliser: float | torch.Tensor | None = None, max_response_length: int | None = None) -> torch.Tensor:
    """Aggregate a per-token loss into the scalar to back-propagate (see the module docstring for the modes).

    Args:
        loss_mat: (B, R) per-token loss (e.g. `TokenLoss.loss_mat`, times rollout-correction weights).
        mask: (B, R) 1 on tokens in the loss.
        mode: one of LOSS_AGG_MODES.
        normaliser: the whole mini-batch's `loss_normaliser(mask_of_mini_batch, mode, max_response_length)`
            (divided by world size on a sharded rank). None = this batch's own normaliser (a batch that is its own
            mini-batch on one process). 0 gives 0.
        max_response_length: only for the default normaliser of seq-mean-token-sum-norm.

    Returns:
        scalar, same dtype as loss_mat.

    >>> loss = torch.tensor([[1.0, 3.0], [2.0, 0.0]]); mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    >>> [agg_loss(loss, mask, m, max_response_length=4).item() for m in LOSS_AGG_MODES]
    [2.0, 3.0, 2.0, 0.75]
    """
    if normaliser is None:
        normaliser = loss_normaliser(mask, mode, max_response_length)
    elif mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {LOSS_AGG_MODES}")
    if mode == "seq-mean-token-mean":
        row_tokens = (mask != 0).sum(dim=-1, keepdim=True)
        row_means = masked_row_sum(loss_mat, mask) / row_tokens.clamp(min=1).to(loss_mat.dtype)  # empty row: 0 / 1
        return _divide(row_means.sum(), normaliser)
    return _divide(masked_sum(loss_mat, mask), normaliser)
