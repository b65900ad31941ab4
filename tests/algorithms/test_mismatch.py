"""The per-step trainer/engine mismatch metrics against a hand computation, and their groups."""

from __future__ import annotations

import math

import pytest
import torch

from vlmrl.actor.step_metrics import mean_metrics
from vlmrl.algorithms.mismatch import MismatchAccumulator, modality


def test_the_metrics_equal_a_hand_computation():
    old = torch.tensor([[-2.0, -2.0, 0.0], [-1.0, -0.5, -3.0]])
    rollout = torch.tensor([[-2.3, -2.1, 9.0], [-1.0, -0.7, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # the 9.0 sits under padding: never read
    acc = MismatchAccumulator(threshold=0.25)
    acc.add(old[:1], rollout[:1], mask[:1], ["geo"], ["image"])  # two micro-batches, combined exactly
    acc.add(old[1:], rollout[1:], mask[1:], ["chart"], ["text"])
    got = acc.metrics()
    r = [0.3, 0.1, 0.0, 0.2, -1.0]  # old - rollout on the five real tokens
    w = [math.exp(x) for x in r]
    n = len(r)
    assert got["mismatch/k1"] == pytest.approx(sum(-x for x in r) / n)
    assert got["mismatch/k3"] == pytest.approx(sum(wi - 1 - x for wi, x in zip(w, r)) / n)
    assert got["mismatch/chi2"] == pytest.approx(sum((wi - 1) ** 2 for wi in w) / n)
    assert got["mismatch/ess"] == pytest.approx(sum(w) ** 2 / (n * sum(wi * wi for wi in w)))
    assert got["mismatch/ppl_ratio"] == pytest.approx(math.exp(sum(-x for x in r) / n))
    assert got["mismatch/abs_dlogp_max"] == pytest.approx(1.0)
    assert got["mismatch/over_threshold"] == pytest.approx(2 / 5)
    assert got["mismatch/ratio_p50"] == pytest.approx(sorted(w)[2])
    assert got["mismatch/abs_dlogp_p99"] == pytest.approx(torch.quantile(torch.tensor(r).abs().double(), 0.99).item())
    assert got["mismatch/tokens"] == 5
    # per group: the image row and the text row apart
    assert got["mismatch/source/geo/k1"] == pytest.approx(-0.2) and got["mismatch/modality/image/tokens"] == 2
    assert got["mismatch/source/chart/abs_dlogp_max"] == pytest.approx(1.0)
    assert got["mismatch/modality/text/k1"] == pytest.approx((0.0 - 0.2 + 1.0) / 3)


def test_identical_logprobs_are_a_perfect_match():
    lp = torch.tensor([[-1.5, -0.2]])
    got = MismatchAccumulator().metrics() or {}
    assert got == {}, "no token, no metric"
    acc = MismatchAccumulator()
    acc.add(lp, lp.clone(), torch.ones(1, 2), ["s"], ["text"])
    got = acc.metrics()
    assert got["mismatch/k3"] == 0 and got["mismatch/ess"] == 1 and got["mismatch/over_threshold"] == 0


def test_a_rows_modality_is_read_from_its_inputs():
    assert modality({}) == "text"
    assert modality({"pixel_values": 1, "image_grid_thw": 1}) == "image"
    assert modality({"pixel_values": 1, "pixel_values_videos": 1}) == "video"


def test_several_engines_are_measured_apart_and_ranks_combine_by_tokens():
    """A run with two engines: the rows of engine 1, whose weights are off, show as its group; engine 0 is clean.
    A dp rank that held no row of engine 1 leaves engine 1's figures as the other rank measured them."""
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    rollout = torch.tensor([[-1.0, -1.0], [-1.5, -1.5], [0.0, 0.0]])
    rank0 = MismatchAccumulator()
    rank0.add(old, rollout, torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]), ["s"] * 3, ["text"] * 3, [0, 1, -1])
    got = rank0.metrics()
    assert got["mismatch/engine/0/k3"] == 0 and got["mismatch/engine/0/tokens"] == 2
    assert got["mismatch/engine/1/k1"] == pytest.approx(-0.5) and "mismatch/engine/-1/tokens" not in got
    rank1 = MismatchAccumulator()
    rank1.add(old[:1], rollout[:1], torch.ones(1, 2), ["s"], ["text"], [0])
    both = mean_metrics([got, rank1.metrics()])
    assert both["mismatch/engine/1/k1"] == pytest.approx(-0.5), "rank 1 had no row of engine 1"
    assert both["mismatch/k1"] == pytest.approx(-0.5 * 2 / 6)  # over the 6 tokens of both ranks
    assert both["mismatch/engine/0/tokens"] + both["mismatch/engine/1/tokens"] == both["mismatch/tokens"]
    with pytest.raises(ValueError, match="2 engine indices for 3 rows"):
        rank0.add(old, rollout, torch.ones(3, 2), ["s"] * 3, ["text"] * 3, [0, 1])
