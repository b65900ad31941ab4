"""Paired statistics for "is 0.33 vs 0.40 noise?": cluster bootstrap intervals and an exact paired sign-flip test.

On scipy.stats (bootstrap, binomtest, permutation_test). The unit is the dataset ROW: its n samples share a prompt
and are not independent, so every statistic first averages a row's samples (mean@n) and then treats rows as the
independent draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

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
    if values.size == 1 or np.all(values == values[0]):  # scipy has no interval of a constant (it warns, gives nan)
        return (float(values[0]), float(values[0]))
    result = stats.bootstrap((values,), np.mean, n_resamples=resamples, confidence_level=level, method="percentile",
                             rng=np.random.default_rng(SEED))
    return (float(result.confidence_interval.low), float(result.confidence_interval.high))


def _abs_sum(d: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.abs(d.sum(axis=axis))


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
        return float(stats.binomtest(int((d > 0).sum()), m).pvalue), "exact McNemar (binomial on discordant rows)"
    # One sample with permutation_type="samples" flips the sign of each difference; P(|sum| >= |observed sum|).
    exact = m <= EXACT_ENUMERATION_MAX
    result = stats.permutation_test((d,), _abs_sum, permutation_type="samples", vectorized=True,
                                    n_resamples=2**m if exact else PERMUTATION_RESAMPLES, alternative="greater",
                                    rng=np.random.default_rng(SEED))
    # Sampled: scipy counts the observed pattern as one of the draws ((hits + 1) / (draws + 1)), so p > 0.
    return float(result.pvalue), "exact sign-flip" if exact else f"Monte Carlo sign-flip ({PERMUTATION_RESAMPLES} draws)"


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
