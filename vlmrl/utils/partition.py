"""Balanced partitions of weighted items (row lengths): Karmarkar-Karp's largest differencing method for k sets.

Used to give data-parallel ranks equal token counts and to pack micro-batches to a token budget (verl and EasyR1
balance their batches the same way). Pure functions over ints: no tensors, no process groups.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class _Partial:
    """A partial solution: k sets of item indices with their sums, kept sorted by sum, largest first."""

    __slots__ = ("sets", "sums")

    def __init__(self, sets: list[list[int]], sums: list[int]):
        order = sorted(range(len(sets)), key=lambda i: (-sums[i], -len(sets[i])))
        self.sets = [sets[i] for i in order]
        self.sums = [sums[i] for i in order]

    @property
    def spread(self) -> int:
        return self.sums[0] - self.sums[-1]

    def merged(self, other: _Partial) -> _Partial:
        """Largest set of one with the smallest of the other, and so on: the differencing step."""
        k = len(self.sets)
        return _Partial([self.sets[i] + other.sets[k - 1 - i] for i in range(k)],
                        [self.sums[i] + other.sums[k - 1 - i] for i in range(k)])


def karmarkar_karp(weights: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of `weights` split into k sets whose sums are as equal as the heuristic finds (largest differencing).

    equal_size: every set gets len(weights) / k items (which must divide), for ranks that must run the same number
    of rows. Each index appears exactly once; sets are sorted by their smallest index for a stable order.

    >>> karmarkar_karp([8, 7, 6, 5, 4], 2)  # sums 14 and 16 (a heuristic: the optimum is 15 and 15)
    [[0, 2], [1, 3, 4]]
    >>> karmarkar_karp([10, 1, 1, 10], 2, equal_size=True)
    [[0, 2], [1, 3]]
    """
    n = len(weights)
    if k < 1:
        raise ValueError(f"cannot partition into {k} sets")
    if equal_size and n % k:
        raise ValueError(f"{n} items do not split into {k} sets of equal size")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    if equal_size:  # k items of neighbouring weight start in k different sets
        starts = [order[i:i + k] for i in range(0, n, k)]
        partials = [_Partial([[i] for i in group], [int(weights[i]) for i in group]) for group in starts]
    else:
        partials = [_Partial([[i]] + [[] for _ in range(k - 1)], [int(weights[i])] + [0] * (k - 1)) for i in order]
    if not partials:
        return [[] for _ in range(k)]
    heap = [(-p.spread, tie, p) for tie, p in enumerate(partials)]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = first.merged(second)
        heapq.heappush(heap, (-merged.spread, tie, merged))
        tie += 1
    sets = [sorted(s) for s in heap[0][2].sets]
    return sorted(sets, key=lambda s: (s[0] if s else n, len(s)))


def fewest_bins_under(weights: Sequence[int], budget: int, min_bins: int = 1) -> list[list[int]]:
    """Indices of `weights` in as few balanced sets as the heuristic finds with every set's sum <= budget, at least
    `min_bins` (<= len(weights)) sets and none empty: k starts at max(min_bins, ceil(total / budget)) and grows until
    Karmarkar-Karp's sets fit. Every weight must be <= budget (one item alone always fits, so this ends)."""
    n = len(weights)
    if n == 0:
        return []
    if max(weights) > budget:
        raise ValueError(f"an item of {max(weights)} is over the budget of {budget}: give it a set of its own first")
    if not 1 <= min_bins <= n:
        raise ValueError(f"min_bins={min_bins} must be in [1, {n}]")
    k = max(min_bins, -(-sum(weights) // budget))
    while k < n:
        sets = karmarkar_karp(weights, k)
        if all(s for s in sets) and all(sum(weights[i] for i in s) <= budget for s in sets):
            return sets
        k += 1
    return [[i] for i in range(n)]
