"""DAPO's data-side helpers (Yu et al. 2025, arXiv:2503.14476): overlong reward shaping, the group filter of dynamic
sampling, and taking truncated responses out of the loss. Pure functions; the loop decides when to call them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlmrl.algorithms.advantages import has_signal, real_groups

TRUNCATED = "length"
"""The finish_reason of a response cut at max_response_length (both engines and the HF reference use it)."""


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (verl's reward_model.overlong_buffer): 0 up to max_response_length -
    buffer_len tokens, then falling linearly to -penalty_factor at max_response_length. Add it to the reward.

    Args:
        response_lengths: (B,) tokens generated per row.
        max_response_length: the generation budget (data.max_response_length).
        buffer_len: tokens before the budget over which the penalty ramps (0 < buffer_len <= max_response_length;
            DAPO uses 4096 of 20480).
        penalty_factor: the penalty at the budget (DAPO: 1.0).

    Returns:
        (B,) float32 penalties, <= 0.

    >>> overlong_penalty(torch.tensor([10, 16, 18, 20]), max_response_length=20, buffer_len=4).tolist()
    [0.0, 0.0, -0.5, -1.0]
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"need 0 < buffer_len <= max_response_length; got {buffer_len} and {max_response_length}")
    exceed = torch.clamp(response_lengths.to(torch.float64) - (max_response_length - buffer_len), min=0.0)
    return (-exceed / buffer_len * penalty_factor).to(torch.float32) + 0.0  # + 0.0: no -0.0 before the buffer


def groups_with_signal(rewards: torch.Tensor, uids: Sequence[str], is_padding: torch.Tensor | None = None
                       ) -> set[str]:
    """The uids whose real rows' rewards are not all equal: the groups dynamic sampling keeps.

    Exactly the groups to which `group_advantages` gives a non-zero advantage (same equality rule). A group of one
    sample is dropped: GRPO gives it no signal (verl's DAPO filter keeps singletons, meant for n = 1 runs).

    >>> sorted(groups_with_signal(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5]), ["a", "a", "b", "b", "c"]))
    ['a']
    """
    scores, _, groups = real_groups(rewards, uids, is_padding)
    return {uid for uid, index in groups.items() if has_signal(scores[index])}


@dataclass(frozen=True)
class GroupSelection:
    """What dynamic sampling keeps of one draw (`select_groups`)."""

    rows: list[int]
    """Positions of the kept rows, in order (every sample of each kept group)."""
    taken: int
    """Groups kept: those with signal, first come, up to the room left in the batch."""
    dropped: int
    """Groups without signal (all rewards equal, or a single sample)."""
    surplus: int
    """Groups with signal beyond the room (drawn, not trained on)."""


def select_groups(rewards: torch.Tensor, uids: Sequence[str], room: int) -> GroupSelection:
    """Dynamic sampling's pick from one draw of rollouts: the first `room` groups (in draw order) whose rewards
    differ (`groups_with_signal`), every sample of each. verl's DAPO trainer does the same: it keeps the groups
    with a non-zero reward std and trims the accumulated batch to train_batch_size groups, in order.

    Args:
        rewards: (B,) the draw's rewards (shaping included).
        uids: (B,) group ids; a group's samples need not be adjacent.
        room: groups the batch still needs.

    >>> select_groups(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]), list("aabbccdd"), room=2)
    GroupSelection(rows=[0, 1, 4, 5], taken=2, dropped=1, surplus=1)
    """
    signal = groups_with_signal(rewards, uids)
    ordered = list(dict.fromkeys(uids))
    taken = [uid for uid in ordered if uid in signal][: max(room, 0)]
    chosen = set(taken)
    return GroupSelection(rows=[i for i, uid in enumerate(uids) if uid in chosen], taken=len(taken),
                          dropped=len(ordered) - len(signal), surplus=len(signal) - len(taken))


def mask_truncated(response_mask: torch.Tensor, finish_reasons: Sequence[str]) -> torch.Tensor:
    """(B, R) response_mask with the rows of truncated responses (finish_reason "length") zeroed: DAPO's overlong
    filtering, so a response cut mid-thought is not punished (or rewarded) as if it were an answer.

    >>> mask_truncated(torch.ones(2, 2), ["stop", "length"]).tolist()
    [[1.0, 1.0], [0.0, 0.0]]
    """
    if len(finish_reasons) != response_mask.shape[0]:
        raise ValueError(f"{len(finish_reasons)} finish reasons for {response_mask.shape[0]} rows")
    cut = torch.tensor([reason == TRUNCATED for reason in finish_reasons], device=response_mask.device)
    return torch.where(cut.unsqueeze(-1), torch.zeros_like(response_mask), response_mask)
