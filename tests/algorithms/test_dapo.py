"""DAPO helpers: overlong shaping, the dynamic-sampling group filter, truncated-response masking."""

from __future__ import annotations

import random

import pytest
import torch

from vlmrl.algorithms.advantages import group_advantages
from vlmrl.algorithms.dapo import groups_with_signal, mask_truncated, overlong_penalty


def verl_overlong_reward(length: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    """volcengine/verl verl/workers/reward_manager/dapo.py, written out."""
    expected_len = max_resp_len - buffer_len
    exceed_len = length - expected_len
    return min(-exceed_len / buffer_len * factor, 0)


@pytest.mark.parametrize("max_len, buffer, factor", [(64, 16, 1.0), (20, 20, 0.5), (10, 1, 2.0)])
def test_overlong_penalty_matches_verls_overlong_buffer(max_len, buffer, factor):
    lengths = torch.arange(0, max_len + 1)
    got = overlong_penalty(lengths, max_len, buffer, factor)
    expected = torch.tensor([verl_overlong_reward(n, max_len, buffer, factor) for n in lengths.tolist()])
    torch.testing.assert_close(got, expected.float())
    assert (got <= 0).all() and got[-1].item() == -factor


def test_overlong_penalty_with_the_dapo_papers_numbers():
    # DAPO (arXiv:2503.14476): max 20480 tokens, 4096 of them the soft punishment buffer
    got = overlong_penalty(torch.tensor([1000, 16384, 18432, 20480]), 20480, 4096)
    assert got.tolist() == [0.0, 0.0, -0.5, -1.0]


def test_overlong_penalty_rejects_a_bad_buffer():
    for buffer in (0, 21):
        with pytest.raises(ValueError, match="buffer_len"):
            overlong_penalty(torch.tensor([1]), 20, buffer)


@pytest.mark.parametrize("seed", range(5))
def test_groups_with_signal_are_exactly_the_groups_grpo_gives_an_advantage(seed):
    rng = random.Random(seed)
    rewards, uids = [], []
    for g in range(20):
        n = rng.choice([1, 2, 4, 8])
        values = [rng.choice([0.1, 0.9, 1.0])] * n if rng.random() < 0.4 else [rng.choice([0.1, 0.9, 1.0])
                                                                                 for _ in range(n)]
        rewards += values
        uids += [f"g{g}"] * n
    rewards = torch.tensor(rewards)
    adv = group_advantages(rewards, uids)
    with_advantage = {uid for uid, a in zip(uids, adv.tolist(), strict=True) if a != 0}
    assert groups_with_signal(rewards, uids) == with_advantage


def test_groups_with_signal_ignore_padding_rows_and_drop_singletons():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.3])
    uids = ["a", "a", "a", "b", "c"]
    padding = torch.tensor([False, False, True, False, False])
    # group a's only differing reward is a padding row's: no signal. Deliberate difference from verl's DAPO filter
    # (recipe/dapo: kept if std > 0 or the group has one sample): a singleton gets no GRPO advantage, so it is dropped
    assert groups_with_signal(rewards, uids, padding) == set()
    assert groups_with_signal(rewards, uids) == {"a"}


def test_mask_truncated_zeroes_rows_cut_by_length():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    got = mask_truncated(mask, ["stop", "length", "abort"])
    assert torch.equal(got, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]]))
    with pytest.raises(ValueError, match="finish reasons"):
        mask_truncated(mask, ["stop"])


def test_select_groups_takes_the_first_groups_with_signal_up_to_the_room():
    """verl's DAPO filter keeps the groups with a non-zero reward std, in draw order, and trims the batch to the
    groups it needs; groups need not be adjacent in the draw."""
    from vlmrl.algorithms.dapo import select_groups

    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.0, 1.0, 0.5])
    uids = ["a", "b", "a", "c", "b", "c", "d", "d", "e"]  # a: no signal, e: one sample
    pick = select_groups(rewards, uids, room=2)
    assert (pick.rows, pick.taken, pick.dropped, pick.surplus) == ([1, 3, 4, 5], 2, 2, 1)
    assert select_groups(rewards, uids, room=0).rows == []
    everything = select_groups(rewards, uids, room=10)
    assert everything.taken == 3 and sorted({uids[i] for i in everything.rows}) == ["b", "c", "d"]
