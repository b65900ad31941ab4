"""Which waiting turns share a backend call: same sampling, and never more new tokens than any member's context
allows (the engine rejects prompt + max_new_tokens over its context length)."""

from __future__ import annotations

import doctest

import pytest

from vlmrl.agent import batcher, parser
from vlmrl.agent.batcher import plan_batch


@pytest.mark.parametrize("module", [batcher, parser])
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0


def test_a_turn_near_the_end_of_its_context_is_not_given_a_longer_call():
    # a resumed trajectory with room for 12 tokens must not join a fresh turn that asks for 64
    pending = [("k", 64, None), ("k", 12, 12), ("k", 64, 900), ("k", 12, 500)]
    assert plan_batch(pending) == [0, 2, 3]
    assert plan_batch(pending[1:]) == [0, 2]  # led by the small one: only turns asking <= 12 tokens join
    assert plan_batch(pending, max_requests=2) == [0, 2]


def test_only_equal_sampling_settings_share_a_call():
    assert plan_batch([("greedy", 8, None), ("hot", 8, None), ("greedy", 4, None)]) == [0, 2]
