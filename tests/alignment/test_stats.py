"""Paired statistics: exact values where they are known, and the behaviour a user relies on ('is it noise?')."""

from __future__ import annotations

import numpy as np
import pytest

from vlmrl.alignment.stats import bootstrap_ci, paired_score, sign_flip_test


def test_mcnemar_exact_on_binary_rewards():
    # 5 discordant rows, all in B's favour: P(|2K-5| >= 5) = 2/32.
    p, test = sign_flip_test(np.array([1, 1, 1, 1, 1, 0, 0, 0], dtype=float))
    assert p == pytest.approx(2 / 32) and "McNemar" in test
    # 3 for B, 2 for A out of 5 discordant: nothing to see.
    p, _ = sign_flip_test(np.array([1, 1, 1, -1, -1], dtype=float))
    assert p == pytest.approx(1.0)


def test_exact_sign_flip_matches_brute_force():
    d = np.array([0.9, 0.1, 0.5, -0.2, 0.3])
    p, test = sign_flip_test(d)
    sums = [abs(sum(s * x for s, x in zip(signs, d))) for signs in np.array(np.meshgrid(*[[-1, 1]] * 5)).T.reshape(-1, 5)]
    assert test == "exact sign-flip" and p == pytest.approx(np.mean(np.array(sums) >= abs(d.sum()) - 1e-9))


def test_monte_carlo_is_deterministic_and_detects_a_shift():
    rng = np.random.default_rng(3)
    shifted = rng.normal(0.3, 0.5, 60)
    p1, test = sign_flip_test(shifted)
    p2, _ = sign_flip_test(shifted)
    assert "Monte Carlo" in test and p1 == p2 and p1 < 0.01
    centred = rng.normal(0.0, 0.5, 60)
    assert sign_flip_test(centred)[0] > 0.05


def test_no_difference_gives_p_one():
    assert sign_flip_test(np.zeros(10))[0] == 1.0


def test_bootstrap_ci_brackets_the_mean_and_narrows_with_more_rows():
    rng = np.random.default_rng(0)
    small, large = rng.integers(0, 2, 20).astype(float), rng.integers(0, 2, 2000).astype(float)
    lo_s, hi_s = bootstrap_ci(small)
    lo_l, hi_l = bootstrap_ci(large)
    assert lo_s <= small.mean() <= hi_s and lo_l <= large.mean() <= hi_l
    assert hi_l - lo_l < (hi_s - lo_s) / 3


def test_paired_score_reports_both_sides_and_the_delta():
    a = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    b = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    score = paired_score(a, b)
    assert (score.rows, score.mean_a, score.mean_b) == (6, 0.5, 5 / 6)
    assert score.delta == pytest.approx(1 / 3) and score.p_value == pytest.approx(0.5)  # 2 discordant rows
    with pytest.raises(ValueError, match="same rows"):
        paired_score(a, b[:3])


def test_mcnemar_on_thousands_of_discordant_rows():
    """2**1024 overflows a float: a big sampled validation set (>= 1024 rows that differ) used to crash here."""
    balanced = np.array([1.0, -1.0] * 700)
    p, test = sign_flip_test(balanced)
    assert p == pytest.approx(1.0) and "McNemar" in test
    shifted = np.array([1.0] * 800 + [-1.0] * 600)  # 800 vs 600 of 1400: z ~ 5.3
    p, _ = sign_flip_test(shifted)
    assert 0.0 < p < 1e-6
