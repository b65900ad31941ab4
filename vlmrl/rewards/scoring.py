"""Scoring a run's responses: its reward function, and request-major batches of responses scored against their
requests (training steps and validation both score this way).

    reward_fn = load_reward_fn(config.reward, dataset.data_sources())
    scores = score_texts(reward_fn, requests, response_texts(tokenizer, results), n, config.reward)
    scores.values, scores.parts, scores.failures
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlmrl.rewards.base import RewardFn, RewardInput, compute_rewards
from vlmrl.rewards.registry import get_reward_fn
from vlmrl.rewards.workers import workers_for

if TYPE_CHECKING:  # scoring imports no torch: reward worker processes import this package
    from vlmrl.config import RewardConfig
    from vlmrl.types import RolloutRequest, RolloutResult


@dataclass
class Scores:
    """The rewards of a batch of responses, request-major (n per request) like the responses they score."""

    values: list[float]
    """Each response's score; 0.0 where the reward function failed."""
    parts: list[dict[str, float]]
    """Each response's named reward parts plus `reward_failed` (and `reward_timeout` under a time limit)."""
    failures: int
    """Responses whose reward function failed or overran reward.timeout_s (timeouts included)."""


def load_reward_fn(config: RewardConfig, data_sources: Iterable[str]) -> RewardFn:
    """The run's reward function (reward.function). With reward.timeout_s its worker processes start now, so a
    function that cannot run in a worker stops the run here rather than after the first rollout."""
    reward_fn = get_reward_fn(config.function, data_sources)
    if config.timeout_s:
        workers_for(reward_fn, config.num_workers)
    return reward_fn


def response_texts(tokenizer, results: Sequence[RolloutResult]) -> list[str]:
    """What a reward function reads of each result: its response decoded with special tokens skipped (as verl does).
    `tokenizer` is the processor's (a transformers tokenizer)."""
    return tokenizer.batch_decode([r.response_ids for r in results], skip_special_tokens=True)


def score_texts(reward_fn: RewardFn, requests: Sequence[RolloutRequest], texts: Sequence[str], n: int,
                config: RewardConfig) -> Scores:
    """Score every response text (request-major, n per request) against its request's data_source, ground truth and
    extra_info. A failing reward function, or one overrunning reward.timeout_s, scores 0 with `reward_failed = 1`
    and the run goes on (`vlmrl.rewards.compute_rewards`)."""
    if len(texts) != n * len(requests):
        raise ValueError(f"{len(texts)} responses for {len(requests)} requests x n={n}: scoring needs n per request")
    items = [RewardInput.from_request(requests[i // n], text) for i, text in enumerate(texts)]
    values, parts, failures = compute_rewards(reward_fn, items, timeout_s=config.timeout_s,
                                              num_workers=config.num_workers)
    return Scores(values, parts, failures)
