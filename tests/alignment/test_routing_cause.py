"""compare's `routing` cause (`vlmrl.alignment.routing`, `vlmrl.alignment.diff`): a MoE sample whose logprob gap
follows a token routed through other experts is named for it, with the first such token and the first MoE layer;
a routing difference only after the gap, or no routing recorded, leaves the older causes in place."""

from __future__ import annotations

import dataclasses

import torch

from tests.alignment.toy_artifacts import make_side
from vlmrl.alignment.causes import Cause, Thresholds
from vlmrl.alignment.diff import compare_artifacts
from vlmrl.alignment.routing import compare_routing, decode_routing, encode_routing

LAYERS, K = 3, 2


def routing_of(record, changes=()) -> dict:
    """A (layers, expanded prompt + response, k) routing of the record, with (token, layer) pairs changed."""
    tokens = record.expanded_prompt_length + len(record.response_ids)
    ids = torch.stack([torch.arange(tokens) % 4, (torch.arange(tokens) + 1) % 4], dim=-1)
    routing = ids.expand(LAYERS, tokens, K).clone()
    for token, layer in changes:
        routing[layer, token] = torch.tensor([2, 3]) if routing[layer, token, 0] < 2 else torch.tensor([0, 1])
    return encode_routing(routing)


def _sides(gap_token: int, changes, drift: float = 0.5):
    meta_a, records_a = make_side(rows=4)
    meta_b, records_b = make_side(rows=4)
    for a, b in zip(records_a, records_b):
        b.response_logprobs = list(b.response_logprobs)
        b.response_logprobs[gap_token] += drift
        a.routing = routing_of(a)
        b.routing = routing_of(b, [(a.expanded_prompt_length - 1 + c, layer) for c, layer in changes])
    return meta_a, records_a, meta_b, records_b


def test_encoding_round_trips_and_the_comparison_names_token_and_layer():
    routing = torch.randint(0, 8, (3, 17, 2))
    assert torch.equal(decode_routing(encode_routing(routing)), routing)
    other = routing.clone()
    other[2, 5] = (other[2, 5] + 1) % 8
    other[1, 9] = other[1, 9].flip(0)  # the same set in another order: the same experts
    agreement = compare_routing(routing, other)
    assert (agreement.first_token, agreement.first_layer, agreement.differing_pairs) == (5, 2, 1)
    assert "the first at token 5; the first MoE layer that differs: 2" in agreement.describe()


def test_a_gap_after_tokens_routed_elsewhere_is_routing():
    """The second MoE layer routes the response's first token (response position 0) through other experts on side
    B; the largest logprob gap is at response token 3: cause routing, naming layer 1."""
    comparison = compare_artifacts(*_sides(gap_token=3, changes=[(0, 1)]))
    assert comparison.cause_counts == {Cause.ROUTING: 4}
    sample = comparison.samples[0]
    assert "the first MoE layer that differs: 1" in sample.explanation and "0.5 nats apart" in sample.explanation
    assert next(c for c in comparison.checks if c.name == "MoE routing fraction").ok, "reported, not failing"
    strict = compare_artifacts(*_sides(gap_token=3, changes=[(0, 1)]), thresholds=Thresholds(max_routing=0.0))
    assert not next(c for c in strict.checks if c.name == "MoE routing fraction").ok


def test_routing_that_differs_only_after_the_gap_or_is_not_recorded_explains_nothing():
    comparison = compare_artifacts(*_sides(gap_token=1, changes=[(4, 0)]))
    assert comparison.cause_counts == {Cause.LOGPROB_DRIFT: 4}
    meta_a, records_a, meta_b, records_b = _sides(gap_token=3, changes=[(0, 1)])
    records_b = [dataclasses.replace(r, routing=None) for r in records_b]
    assert compare_artifacts(meta_a, records_a, meta_b, records_b).cause_counts == {Cause.LOGPROB_DRIFT: 4}
