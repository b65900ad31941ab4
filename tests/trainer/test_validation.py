"""Validation metrics: per data source, accuracy from the reward's `accuracy` part, mean@k and pass@k."""

from __future__ import annotations

import pytest

from vlmrl.trainer.validation import validation_metrics
from vlmrl.types import RolloutRequest, RolloutResult


def _requests_and_results(sources: list[str], n: int, lengths: list[int]):
    requests = [RolloutRequest(uid=f"u{i}", prompt_ids=[1], data_source=s, index=i) for i, s in enumerate(sources)]
    results = [RolloutResult(uid=f"u{i // n}", sample_index=i % n, response_ids=[7] * length,
                             response_logprobs=[0.0] * length, finish_reason="stop")
               for i, length in enumerate(lengths)]
    return requests, results


def test_accuracy_per_source_and_mean_at_k():
    # two prompts of geo3k and one synthetic, 2 samples each (request-major)
    requests, results = _requests_and_results(["geo3k", "geo3k", "synthetic/colour"], 2, [3, 1, 2, 2, 4, 4])
    accuracy = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    scores = [0.9 * a + 0.1 for a in accuracy]  # geo3k-style score: the part, not the score, is the accuracy
    parts = [{"accuracy": a, "format": 1.0} for a in accuracy]
    metrics = validation_metrics(requests, results, scores, parts, n=2)
    assert metrics["val/accuracy"] == pytest.approx(0.5)
    assert metrics["val/reward"] == pytest.approx(0.55)
    assert metrics["val/geo3k/accuracy"] == pytest.approx(0.25)
    assert metrics["val/synthetic/colour/accuracy"] == pytest.approx(1.0)
    assert metrics["val/mean@2"] == pytest.approx(0.5)
    assert metrics["val/pass@2"] == pytest.approx(2 / 3)  # prompts 0 and 2 have a correct sample
    assert metrics["val/geo3k/pass@2"] == pytest.approx(0.5)
    assert metrics["val/reward_extra/format"] == 1.0
    assert metrics["val/num_prompts"] == 3 and metrics["val/num_samples"] == 6
    assert metrics["val/response_length/mean"] == pytest.approx(16 / 6)


def test_without_an_accuracy_part_the_score_is_the_accuracy_and_no_mean_at_1():
    requests, results = _requests_and_results(["a", "b"], 1, [1, 1])
    metrics = validation_metrics(requests, results, [1.0, 0.0], [{}, {}], n=1)
    assert metrics["val/accuracy"] == 0.5 and metrics["val/a/accuracy"] == 1.0 and metrics["val/b/accuracy"] == 0.0
    assert not any("@" in key for key in metrics)
