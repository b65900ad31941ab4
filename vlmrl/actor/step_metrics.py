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
    *_min / *_max take the extreme (`combine_metric`). A measure of a group of tokens that counts them
    (`<group>/tokens` beside it: the mismatch/* groups) is averaged over the tokens instead, so a rank that held none
    of a group's rows (no image row, no row of engine 1) leaves the group's figure as it is.

    >>> mean_metrics([{"a": 1.0, "g/k3": 2.0, "g/tokens": 3.0}, {"a": 3.0}])
    {'a': 2.0, 'g/k3': 2.0, 'g/tokens': 1.5}
    """
    totals: dict[str, float] = {}
    weighted: dict[str, list[float]] = {}  # key -> [sum of value x tokens, tokens]
    for metrics in parts:
        for key, value in metrics.items():
            totals[key] = combine_metric(key, totals.get(key), value)
            group, _, name = key.rpartition("/")
            tokens = metrics.get(f"{group}/tokens") if group and name != "tokens" else None
            if tokens is not None and not is_extreme(key):
                pair = weighted.setdefault(key, [0.0, 0.0])
                pair[0] += value * tokens
                pair[1] += tokens
    out = {key: value if is_extreme(key) else value / len(parts) for key, value in totals.items()}
    out.update({key: total / tokens for key, (total, tokens) in weighted.items() if tokens > 0})
    return out
