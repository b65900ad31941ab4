"""Paired statistics for "is 0.33 vs 0.40 noise?": cluster bootstrap intervals and an exact paired sign-flip test.

Pure numpy (no scipy needed). The unit is the dataset ROW: its n samples share a prompt and are not independent, so
every statistic first averages a row's samples (mean@n) and then treats rows as the independent draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
PERMUTATION_RESAMPLES = 20000
EXACT_ENUMERATION_MAX = 16
"""Up to this many non-zero paired differences the sign-flip test enumerates all 2^m sign patterns."""
SEED = 0
"""Fixed: the same two artifacts always give the same intervals and p-values."""


@dataclass
class PairedScore:
    """Mean score of each side over the same rows, their difference, and whether it is noise."""

    rows: int
    mean_a: float
    ci_a: tuple[float, float]
    mean_b: float
    ci_b: tuple[float, float]
    delta: float
    """mean_b - mean_a."""
    ci_delta: tuple[float, float]
    p_value: float
    """Two-sided paired test of 'no difference' (1.0 when the sides agree on every row)."""
    test: str
    """Which test produced p_value: exact binomial (McNemar), exact sign-flip, or Monte Carlo sign-flip."""


def bootstrap_ci(values: np.ndarray, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (R,), resampling rows with replacement."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return (math.nan, math.nan)
    if values.size == 1 or np.all(values == values[0]):
        return (float(values[0]), float(values[0]))
    rng = np.random.default_rng(SEED)
    picks = rng.integers(0, values.size, size=(resamples, values.size))  # (resamples, R)
    means = values[picks].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return (float(low), float(high))


def _binomial_two_sided(k: int, m: int) -> float:
    """P(|2K - m| >= |2k - m|) for K ~ Binomial(m, 1/2): the exact McNemar test on m discordant pairs."""
    observed = abs(2 * k - m)
    tail = sum(math.comb(m, j) for j in range(m + 1) if abs(2 * j - m) >= observed)
    return min(1.0, tail / (1 << m))  # int / int: exact, no float overflow at m >= 1024


def sign_flip_test(differences: np.ndarray) -> tuple[float, str]:
    """Two-sided paired test of mean(differences) == 0; differences (R,) = per-row score_b - score_a.

    Under 'no difference' each row's difference is as likely to have either sign. Rows with difference 0 carry no
    information and are dropped. When every non-zero difference has the same size (0/1 rewards) this is exactly
    McNemar's test; otherwise all 2^m sign patterns are enumerated (m <= 16) or sampled (seeded)."""
    d = np.asarray(differences, dtype=np.float64)
    d = d[np.abs(d) > 1e-12]
    m = d.size
    if m == 0:
        return 1.0, "no differing rows"
    magnitudes = np.abs(d)
    if np.allclose(magnitudes, magnitudes[0], rtol=1e-9, atol=1e-12):
        return _binomial_two_sided(int((d > 0).sum()), m), "exact McNemar (binomial on discordant rows)"
    observed = abs(d.sum()) - 1e-12 * m
    if m <= EXACT_ENUMERATION_MAX:
        patterns = ((np.arange(2**m)[:, None] >> np.arange(m)) & 1) * 2 - 1  # (2^m, m) of +-1
        sums = np.abs(patterns @ d)
        return float((sums >= observed).mean()), "exact sign-flip"
    rng = np.random.default_rng(SEED)
    hits = 0
    for start in range(0, PERMUTATION_RESAMPLES, 1000):
        count = min(1000, PERMUTATION_RESAMPLES - start)
        signs = rng.integers(0, 2, size=(count, m)) * 2 - 1  # (count, m)
        hits += int((np.abs(signs @ d) >= observed).sum())
    # +1: the observed pattern itself is one of the possible ones (keeps p > 0 and the test valid).
    return (hits + 1) / (PERMUTATION_RESAMPLES + 1), f"Monte Carlo sign-flip ({PERMUTATION_RESAMPLES} draws)"


def paired_score(row_scores_a: np.ndarray, row_scores_b: np.ndarray, level: float = 0.95) -> PairedScore:
    """Compare per-row scores (R,) of two sides on the same rows (row i of a and b is the same dataset row)."""
    a = np.asarray(row_scores_a, dtype=np.float64)
    b = np.asarray(row_scores_b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired scores need the same rows: {a.shape} vs {b.shape}")
    p_value, test = sign_flip_test(b - a)
    return PairedScore(
        rows=int(a.size),
        mean_a=float(a.mean()) if a.size else math.nan,
        ci_a=bootstrap_ci(a, level),
        mean_b=float(b.mean()) if b.size else math.nan,
        ci_b=bootstrap_ci(b, level),
        delta=float((b - a).mean()) if a.size else math.nan,
        ci_delta=bootstrap_ci(b - a, level),
        p_value=p_value,
        test=test,
    )
