"""How an update's per-step (or per-rank) metrics combine into one: sums averaged, *_min / *_max kept extreme."""

from __future__ import annotations

from collections.abc import Sequence


def combine_metric(key: str, total: float | None, value: float) -> float:
    """Fold `value` into a running metric: *_min / *_max keep the extreme, every other key sums (averaged later)."""
    if total is None:
        return value
    if key.endswith("_min"):
        return min(total, value)
    if key.endswith("_max"):
        return max(total, value)
    return total + value


def is_extreme(key: str) -> bool:
    """A metric combined by min / max, not averaged."""
    return key.endswith(("_min", "_max"))


def mean_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Average each metric over `parts` (optimizer steps, or dp ranks), a part without the key counting as 0;
    *_min / *_max take the extreme (`combine_metric`)."""
    totals: dict[str, float] = {}
    for metrics in parts:
        for key, value in metrics.items():
            totals[key] = combine_metric(key, totals.get(key), value)
    return {key: value if is_extreme(key) else value / len(parts) for key, value in totals.items()}
