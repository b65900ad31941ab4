"""Advantage estimators against float64 references written here (following the peers' published formulas), padding
invariance, no-signal groups, and the registry."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from vlmrl.algorithms.advantages import (
    ADV_ESTIMATOR_FNS,
    ADV_ESTIMATORS,
    compute_advantages,
    group_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)


def groups_of(uids):
    groups = defaultdict(list)
    for row, uid in enumerate(uids):
        groups[uid].append(row)
    return groups


def ref_grpo(rewards: list[float], uids: list[str], norm_by_std: bool, eps: float = 1e-6) -> list[float]:
    out = [0.0] * len(rewards)
    for rows in groups_of(uids).values():
        values = [rewards[r] for r in rows]
        if len(values) < 2 or max(values) == min(values):
            continue
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        for r in rows:
            out[r] = (rewards[r] - mean) / (std + eps) if norm_by_std else rewards[r] - mean
    return out


def ref_rloo(rewards, uids):
    out = [0.0] * len(rewards)
    for rows in groups_of(uids).values():
        if len(rows) < 2 or len({rewards[r] for r in rows}) == 1:
            continue
        total = sum(rewards[r] for r in rows)
        for r in rows:
            out[r] = rewards[r] - (total - rewards[r]) / (len(rows) - 1)
    return out


def ref_token_whiten(values, lengths):
    """verl's masked_whiten of a (B, R) tensor holding each row's value on its `lengths[i]` tokens."""
    tokens = [v for v, n in zip(values, lengths, strict=True) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    var = sum((t - mean) ** 2 for t in tokens) / len(tokens) * len(tokens) / (len(tokens) - 1)
    return [(v - mean) / (var + 1e-8) ** 0.5 if n else 0.0 for v, n in zip(values, lengths, strict=True)]


def ref_rfpp_baseline(rewards, uids, lengths):
    centred = [0.0] * len(rewards)
    for rows in groups_of(uids).values():
        if len(rows) < 2 or len({rewards[r] for r in rows}) == 1:
            continue
        mean = sum(rewards[r] for r in rows) / len(rows)
        for r in rows:
            centred[r] = rewards[r] - mean
    return ref_token_whiten(centred, lengths)


def random_case(seed: int, groups: int = 12, width: int = 16):
    """Groups of 1..9 samples, some with all-equal rewards, rows shuffled; rewards on geo3k's 0.1 / 0.9 / 1.0 grid
    for half the groups and continuous for the rest."""
    rng = random.Random(seed)
    rewards, uids = [], []
    for g in range(groups):
        n = rng.choice([1, 2, 3, 5, 8, 9])
        kind = rng.random()
        if kind < 0.25:
            values = [rng.choice([0.1, 0.9, 1.0])] * n  # no signal
        elif kind < 0.6:
            values = [rng.choice([0.1, 0.9, 1.0]) for _ in range(n)]
        else:
            values = [rng.gauss(0.0, 3.0) for _ in range(n)]
        rewards += values
        uids += [f"g{g}"] * n
    order = list(range(len(rewards)))
    rng.shuffle(order)
    rewards = [rewards[i] for i in order]
    uids = [uids[i] for i in order]
    lengths = [rng.randint(1, width) for _ in rewards]
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    # float32 rewards, as the reward stage produces them; the references read the same float32 values
    rewards32 = torch.tensor(rewards, dtype=torch.float32)
    return rewards32, uids, mask, rewards32.double().tolist(), lengths


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_reference(seed, norm_by_std):
    rewards, uids, _, ref_rewards, _ = random_case(seed)
    got = group_advantages(rewards, uids, norm_by_std=norm_by_std)
    expected = torch.tensor(ref_grpo(ref_rewards, uids, norm_by_std), dtype=torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", range(6))
def test_rloo_matches_reference(seed):
    rewards, uids, _, ref_rewards, _ = random_case(seed)
    torch.testing.assert_close(rloo_advantages(rewards, uids), torch.tensor(ref_rloo(ref_rewards, uids)),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", range(6))
def test_reinforce_plus_plus_baseline_matches_reference(seed):
    rewards, uids, mask, ref_rewards, lengths = random_case(seed)
    got = reinforce_plus_plus_baseline_advantages(rewards, uids, response_mask=mask)
    torch.testing.assert_close(got, torch.tensor(ref_rfpp_baseline(ref_rewards, uids, lengths)), rtol=1e-6,
                               atol=1e-6)


def verl_reinforce_plus_plus(token_level_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0):
    """verl-project/verl compute_reinforce_plus_plus_outcome_advantage (1dda039: the running return is carried
    through observation tokens, mask 0, unchanged) + masked_whiten (unbiased variance, eps 1e-8 inside the rsqrt),
    written out in float64 for this test."""
    rewards, mask = token_level_rewards.double(), mask.double()
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for t in reversed(range(rewards.shape[1])):
        new_running = rewards[:, t] + gamma * running
        returns[:, t] = new_running * mask[:, t]
        running = new_running * mask[:, t] + running * (1 - mask[:, t])
    mean = (returns * mask).sum() / mask.sum()
    var = ((returns - mean) ** 2 * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    return (returns - mean) * torch.rsqrt(var + 1e-8) * mask


@pytest.mark.parametrize("seed", range(6))
def test_reinforce_plus_plus_matches_verls_token_level_recursion(seed):
    rewards, uids, mask, _, lengths = random_case(seed)
    # the outcome reward sits on each response's last token, as verl's reward manager puts it
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = rewards
    expected = verl_reinforce_plus_plus(token_rewards, mask)
    got = reinforce_plus_plus_advantages(rewards, uids, response_mask=mask)
    torch.testing.assert_close(got[:, None] * mask.double(), expected, rtol=1e-6, atol=1e-6, check_dtype=False)


def test_reinforce_plus_plus_matches_verl_across_tool_turns():
    # multi-turn rows: policy tokens, a tool turn (mask 0), policy tokens again, the outcome reward on the last policy
    # token. verl carries the return through the tool turn: every policy token of a row gets its reward, as here.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 1, 0]], dtype=torch.float32)
    rewards = torch.tensor([1.0, 0.0, 0.5])
    token_rewards = torch.zeros_like(mask)
    token_rewards[[0, 1, 2], [5, 4, 5]] = rewards
    expected = verl_reinforce_plus_plus(token_rewards, mask)
    got = reinforce_plus_plus_advantages(rewards, ["a", "b", "c"], response_mask=mask)
    torch.testing.assert_close(got[:, None] * mask.double(), expected, rtol=1e-6, atol=1e-6, check_dtype=False)


def test_reinforce_plus_plus_weighs_rows_by_tokens():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    long_short = reinforce_plus_plus_advantages(rewards, ["a", "b"], response_mask=mask)
    # tokens (1, 1, 1, 0): mean 0.75, unbiased std 0.5 -> (1 - 0.75) / 0.5, (0 - 0.75) / 0.5
    torch.testing.assert_close(long_short, torch.tensor([0.5, -1.5]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
@pytest.mark.parametrize("seed", range(3))
def test_padding_rows_get_zero_and_change_nothing(estimator, seed):
    rewards, uids, mask, _, _ = random_case(seed)
    real = compute_advantages(estimator, rewards, uids, response_mask=mask)
    extra = 5
    padded_rewards = torch.cat([rewards, torch.tensor([100.0, -50.0, 3.0, 0.0, 1e6])])
    # padding rows: their own uids, and one that shares a real uid (it must still count for nothing)
    padded_uids = uids + ["pad-0", "pad-1", uids[0], "pad-3", "pad-4"]
    padded_mask = torch.cat([mask, torch.ones(extra, mask.shape[1])])  # even a non-zero mask must not count
    is_padding = torch.tensor([False] * len(uids) + [True] * extra)
    got = compute_advantages(estimator, padded_rewards, padded_uids, is_padding, padded_mask)
    assert torch.equal(got[: len(uids)], real)
    assert torch.equal(got[len(uids):], torch.zeros(extra))


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_estimators_give_no_signal_groups_and_singletons_exactly_zero(estimator):
    rewards = torch.tensor([0.9] * 8 + [0.1] * 3 + [0.7] + [1.0, 0.0])
    uids = ["a"] * 8 + ["b"] * 3 + ["lonely"] + ["c", "c"]
    adv = compute_advantages(estimator, rewards, uids)
    assert torch.equal(adv[:12], torch.zeros(12)) and (adv[12:] != 0).all()


def test_reinforce_plus_plus_baseline_centres_no_signal_groups_before_whitening():
    # equal lengths: the centred advantages have batch mean 0, so the whitening shifts nothing and a no-signal group
    # stays exactly 0
    rewards = torch.tensor([0.9, 0.9, 0.9, 1.0, 0.0])
    adv = reinforce_plus_plus_baseline_advantages(rewards, ["a"] * 3 + ["b"] * 2, response_mask=torch.ones(5, 4))
    assert torch.equal(adv[:3], torch.zeros(3)) and adv[3] > 0 > adv[4]


def test_whitening_of_a_single_token_batch_is_zero_not_nan():
    for fn in (reinforce_plus_plus_advantages, reinforce_plus_plus_baseline_advantages):
        assert torch.equal(fn(torch.tensor([1.0]), ["a"], response_mask=torch.ones(1, 1)), torch.zeros(1))


def test_estimators_compute_in_float64_and_return_the_callers_precision():
    assert group_advantages(torch.tensor([1.0, 0.0]), ["a", "a"]).dtype == torch.float32
    assert group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), ["a", "a"]).dtype == torch.float64
    assert group_advantages(torch.tensor([1, 0]), ["a", "a"]).dtype == torch.float32


def test_registry_and_names_agree():
    assert tuple(ADV_ESTIMATOR_FNS) == ADV_ESTIMATORS
    with pytest.raises(ValueError, match="reinforce_plus_plus"):
        compute_advantages("gae", torch.zeros(2), ["a", "a"])
    with pytest.raises(ValueError, match="grpo estimator only"):
        compute_advantages("rloo", torch.zeros(2), ["a", "a"], norm_by_std=False)


# --- peers' published cases ----------------------------------------------------------------------------------------


def verl_group_index(batch_size: int, num_groups: int, rng: random.Random) -> list[str]:
    """volcengine/verl tests/trainer/ppo/test_core_algos_on_cpu.py _make_group_index: >= 2 samples per group."""
    counts = [2] * num_groups
    for _ in range(batch_size - 2 * num_groups):
        counts[rng.randrange(num_groups)] += 1
    index = [f"{gid}" for gid, c in enumerate(counts) for _ in range(c)]
    rng.shuffle(index)
    return index


def verl_grpo(scores: torch.Tensor, index: list[str], norm: bool, eps: float = 1e-6) -> torch.Tensor:
    """verl compute_grpo_outcome_advantage's loop (float32 torch, as verl runs it)."""
    out = scores.clone()
    groups = groups_of(index)
    for i in range(len(index)):
        group = scores[groups[index[i]]]
        out[i] = (scores[i] - group.mean()) / (group.std() + eps) if norm else scores[i] - group.mean()
    return out


def verl_rloo(scores: torch.Tensor, index: list[str]) -> torch.Tensor:
    out = scores.clone()
    groups = groups_of(index)
    for i in range(len(index)):
        n = len(groups[index[i]])
        mean = scores[groups[index[i]]].mean()
        out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return out


@pytest.mark.parametrize("batch_size, seq_len, num_groups, seed", [(64, 128, 5, 0), (128, 256, 8, 1),
                                                                    (512, 512, 10, 2)])
def test_verl_grpo_and_rloo_equivalence_cases(batch_size, seq_len, num_groups, seed):
    # Mirrors volcengine/verl test_grpo_and_vectorized_equivalence / test_rloo_and_vectorized_equivalence: same sizes
    # and seeds, token-level randn rewards under a random mask (>= 1 token a row), summed per row; verl compares two
    # of its own implementations at rtol 1e-5 / atol 1e-6, we compare ours with its loop at the same tolerance.
    # Continuous rewards: every group has signal, so our no-signal rule never differs from verl's formula here.
    torch.manual_seed(seed)
    rng = random.Random(seed)
    index = verl_group_index(batch_size, num_groups, rng)
    mask = torch.randint(0, 2, (batch_size, seq_len)).float()
    mask[mask.sum(-1) == 0, -1] = 1.0
    scores = (torch.randn(batch_size, seq_len) * mask).sum(-1)
    for norm in (True, False):
        torch.testing.assert_close(group_advantages(scores, index, norm_by_std=norm), verl_grpo(scores, index, norm),
                                   rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rloo_advantages(scores, index), verl_rloo(scores, index), rtol=1e-5, atol=1e-6)


def test_deliberate_differences_from_the_peers_on_singletons_and_equal_groups():
    # verl gives a singleton group (mean 0, std 1) its raw reward / (1 + eps), RLOO its raw reward, and EasyR1
    # asserts rollout.n > 1. A prompt alone has nothing to be compared with, so every group estimator here gives 0.
    assert group_advantages(torch.tensor([0.7]), ["a"]).item() == 0.0
    assert rloo_advantages(torch.tensor([0.7]), ["a"]).item() == 0.0
    # verl's float32 formula on an all-equal group gives a rounding residue / (0 + eps); ours is exactly 0
    scores = torch.full((8,), 0.9)
    assert verl_grpo(scores, ["a"] * 8, True).abs().max() > 0.01
    assert torch.equal(group_advantages(scores, ["a"] * 8), torch.zeros(8))
