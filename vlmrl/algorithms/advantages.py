"""Outcome advantage estimators: one sequence-level reward per row -> one advantage per row.

Shapes: B = rows (rollout.n samples per prompt, plus padding rows), R = padded response length.
Every estimator computes in float64, gives padding rows (is_padding) exactly 0 and keeps them out of every statistic,
so adding padding rows never changes a real row's advantage. A group (rows sharing a uid) whose rewards are all equal,
or of one real sample, has no signal and its rows get exactly 0 in the group estimators.

The estimators return (B,): with an outcome reward and gamma = 1 every token of a response has the same return, so
even the token-level REINFORCE++ whitening gives one value per row. `broadcast_to_tokens` spreads it over the tokens.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from vlmrl.algorithms.config import ADV_ESTIMATORS

# Rewards closer than this (relative to their magnitude) are equal: float32 rewards that should be equal can differ
# in the last bit after arithmetic, and dividing that difference by std + eps would invent a signal.
_EQUAL_RTOL = 1e-6


def real_groups(rewards: torch.Tensor, uids: Sequence[str], is_padding: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(B,) rewards, B uids, (B,) padding flags -> (float64 rewards on CPU, (B,) bool real-row mask, uid -> index
    tensor of that group's real rows). Padding rows belong to no group."""
    if rewards.dim() != 1 or rewards.shape[0] != len(uids):
        raise ValueError(f"rewards must be (B,) with B == len(uids); got {tuple(rewards.shape)} and {len(uids)} uids")
    real = torch.ones(len(uids), dtype=torch.bool) if is_padding is None else ~is_padding.detach().cpu().to(torch.bool)
    rows: dict[str, list[int]] = defaultdict(list)
    for row, uid in enumerate(uids):
        if real[row]:
            rows[uid].append(row)
    groups = {uid: torch.tensor(index) for uid, index in rows.items()}
    return rewards.detach().cpu().to(torch.float64), real, groups


def has_signal(group: torch.Tensor) -> bool:
    """True when a group's (float64) rewards are not all equal (up to _EQUAL_RTOL of their magnitude)."""
    return len(group) > 1 and bool(group.max() - group.min() > _EQUAL_RTOL * group.abs().max())


def _output(values: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """float64 (B,) -> the caller's float dtype (at least float32), on the rewards' device."""
    return values.to(device=rewards.device, dtype=torch.promote_types(rewards.dtype, torch.float32))


def group_advantages(
    rewards: torch.Tensor,
    uids: Sequence[str],
    is_padding: torch.Tensor | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO outcome advantages: each sample's reward minus its group's mean, divided by the group's std (optional).

    Args:
        rewards: (B,) float, one sequence-level reward per row.
        uids: B group ids; rows with the same uid were sampled from the same prompt.
        is_padding: (B,) bool; padding rows get advantage 0 and never enter any group's statistics.
        norm_by_std: divide by the group std (unbiased, as verl/EasyR1: GRPO); False gives Dr. GRPO's mean-centred
            advantages.
        eps: added to the std.
        response_mask: unused (GRPO advantages are per sequence); accepted so every estimator takes the same call.

    Returns:
        (B,) advantages. A group of one real sample, or whose rewards are all equal, gets exactly 0: it carries no
        signal (verl gives a singleton its raw reward / (1 + eps); we do not reward a prompt for being alone).

    >>> [round(a, 4) for a in group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), ["a", "a", "b", "b"]).tolist()]
    [0.7071, -0.7071, 0.0, 0.0]
    >>> group_advantages(torch.full((8,), 0.9), ["a"] * 8).abs().max().item()
    0.0
    """
    scores, _, groups = real_groups(rewards, uids, is_padding)
    advantages = torch.zeros_like(scores)
    for index in groups.values():
        group = scores[index]
        if not has_signal(group):
            continue
        centred = group - group.mean()
        advantages[index] = centred / (group.std() + eps) if norm_by_std else centred
    return _output(advantages, rewards)


def rloo_advantages(rewards: torch.Tensor, uids: Sequence[str], is_padding: torch.Tensor | None = None,
                    response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO: each sample's reward minus the mean of the OTHER samples of its group (= n / (n-1) * (r - group mean)).

    Args/returns as `group_advantages` (no std normalisation). A singleton or all-equal group gets exactly 0 (verl
    gives a singleton its raw reward).

    >>> rloo_advantages(torch.tensor([1.0, 0.0, 0.0]), ["a"] * 3).tolist()
    [1.0, -0.5, -0.5]
    """
    scores, _, groups = real_groups(rewards, uids, is_padding)
    advantages = torch.zeros_like(scores)
    for index in groups.values():
        group = scores[index]
        if has_signal(group):
            n = len(group)
            advantages[index] = group - (group.sum() - group) / (n - 1)
    return _output(advantages, rewards)


def _whiten_over_tokens(values: torch.Tensor, real: torch.Tensor, response_mask: torch.Tensor | None) -> torch.Tensor:
    """Whiten per-row values as if every real TOKEN carried its row's value (verl's masked_whiten of a (B, R) tensor
    that is constant along each row): the mean and the unbiased variance weight each row by its token count.
    response_mask None = one token per row. Rows that are padding or have no token get 0."""
    if response_mask is None:
        weights = real.to(torch.float64)
    else:
        weights = (response_mask.detach().cpu() != 0).sum(dim=-1).to(torch.float64) * real
    total = weights.sum()
    out = torch.zeros_like(values)
    if total < 2:  # the unbiased variance needs two tokens; one token alone has nothing to be compared with
        return out
    mean = (weights * values).sum() / total
    variance = (weights * (values - mean).square()).sum() / total * total / (total - 1)
    keep = weights > 0
    out[keep] = (values[keep] - mean) * torch.rsqrt(variance + 1e-8)
    return out


def reinforce_plus_plus_advantages(rewards: torch.Tensor, uids: Sequence[str], is_padding: torch.Tensor | None = None,
                                   response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ (outcome reward, gamma = 1): every token's return is its row's reward, whitened over all real
    tokens of the batch (verl's compute_reinforce_plus_plus_outcome_advantage). No group baseline; uids unused.

    Args:
        rewards, uids, is_padding: as `group_advantages`.
        response_mask: (B, R), 1 on policy tokens: a row weighs in the batch mean/std by its token count.
            None = every real row weighs one token.

    Returns:
        (B,) advantages (each row's tokens share it). Every policy token of a multi-turn row, before a hole in the
        mask (a tool turn) too, gets the row's reward: the outcome is the whole trajectory's, and verl's recursion
        carries the return through observation spans in the same way (its returns are 0 only on the masked tokens).
    """
    scores, real, _ = real_groups(rewards, uids, is_padding)
    return _output(_whiten_over_tokens(scores, real, response_mask), rewards)


def reinforce_plus_plus_baseline_advantages(rewards: torch.Tensor, uids: Sequence[str],
                                            is_padding: torch.Tensor | None = None,
                                            response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++-baseline: the group mean is subtracted, then the result is whitened over all real tokens of the
    batch (verl's compute_reinforce_plus_plus_baseline_outcome_advantage).

    Args/returns as `reinforce_plus_plus_advantages`. A singleton or all-equal group is centred to exactly 0 before
    the whitening (verl leaves a singleton its raw reward); the whitening's shift can still move it off 0 when
    responses differ in length, as in verl.
    """
    scores, real, groups = real_groups(rewards, uids, is_padding)
    centred = torch.zeros_like(scores)
    for index in groups.values():
        group = scores[index]
        if has_signal(group):
            centred[index] = group - group.mean()
    return _output(_whiten_over_tokens(centred, real, response_mask), rewards)


ADV_ESTIMATOR_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": group_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
}
"""name -> estimator; every one is called as fn(rewards, uids, is_padding=..., response_mask=...)."""


def compute_advantages(estimator: str, rewards: torch.Tensor, uids: Sequence[str],
                       is_padding: torch.Tensor | None = None, response_mask: torch.Tensor | None = None,
                       norm_by_std: bool = True) -> torch.Tensor:
    """Run the estimator named `estimator` (one of ADV_ESTIMATORS); norm_by_std is GRPO's switch (False = Dr. GRPO).

    Returns:
        (B,) advantages, 0 on padding rows.
    """
    if estimator not in ADV_ESTIMATOR_FNS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ADV_ESTIMATORS}")
    if estimator == "grpo":
        return group_advantages(rewards, uids, is_padding, norm_by_std=norm_by_std)
    if not norm_by_std:
        raise ValueError(f"norm_by_std=False (Dr. GRPO) applies to the grpo estimator only, not {estimator!r}")
    return ADV_ESTIMATOR_FNS[estimator](rewards, uids, is_padding=is_padding, response_mask=response_mask)
