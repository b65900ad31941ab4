"""Chunking: every item lands in exactly one run, in order; the doctests hold."""

from __future__ import annotations

import doctest

import pytest

import vlmrl.utils.sequences
from vlmrl.utils.sequences import chunks, split_evenly


def test_doctests():
    result = doctest.testmod(vlmrl.utils.sequences)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("count, size", [(0, 1), (1, 3), (7, 2), (8, 4), (5, 5)])
def test_chunks_rejoin_in_order_and_only_the_last_is_short(count, size):
    runs = chunks(list(range(count)), size)
    assert [x for run in runs for x in run] == list(range(count))
    assert all(len(run) == size for run in runs[:-1]) and all(0 < len(run) <= size for run in runs)


def test_generation_runs_rejoin_in_request_order():
    """How generation requests are spread over engines and reward samples over workers: sizes differ by at most one,
    the first runs are the longer ones, and joining the runs gives the items back."""
    items = list(range(7))
    runs = split_evenly(items, 3)
    assert [len(r) for r in runs] == [3, 2, 2]
    assert [x for run in runs for x in run] == items
    assert split_evenly([1], 2) == [[1], []]
    assert split_evenly(range(5), 2) == [[0, 1, 2], [3, 4]]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="chunk size must be >= 1"):
        chunks([1, 2], 0)
    with pytest.raises(ValueError, match="cannot split into 0 parts"):
        split_evenly([1, 2], 0)
