"""Cutting a sequence into contiguous runs: by run size (`chunks`) or by number of runs (`split_evenly`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def chunks(items: Sequence[T], size: int) -> list[list[T]]:
    """Consecutive runs of `size` items (the last one may be shorter); joined in order they give `items` back.

    >>> chunks([1, 2, 3, 4, 5], 2)
    [[1, 2], [3, 4], [5]]
    >>> chunks(range(0), 3)
    []
    """
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return [list(items[start : start + size]) for start in range(0, len(items), size)]


def split_evenly(items: Sequence[T], parts: int) -> list[list[T]]:
    """`parts` contiguous runs whose sizes differ by at most one (the first ones longer); some are empty when there
    are fewer items than parts. Joined in order they give `items` back.

    >>> split_evenly([1, 2, 3, 4, 5], 2)
    [[1, 2, 3], [4, 5]]
    >>> split_evenly([1], 3)
    [[1], [], []]
    """
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    size, extra = divmod(len(items), parts)
    runs, start = [], 0
    for part in range(parts):
        end = start + size + (1 if part < extra else 0)
        runs.append(list(items[start:end]))
        start = end
    return runs
