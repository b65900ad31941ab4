"""Scoring: a run's reward (`RewardScorer`: its function and the processes scoring with it holds open), and batches
of responses scored against their requests (training steps and validation both score this way), in this process
without a time limit or in reward worker processes under `reward.timeout_s`.

    reward = RewardScorer.start(config.reward, dataset.data_sources())  # with the run's other parts
    scores = reward.score(requests, response_texts(tokenizer, results), n)
    scores.values, scores.parts, scores.failures
    reward.close()                                                      # with the run's other parts

Every sample gets a score and the same named parts; failures and timeouts are flagged (`reward_failed`,
`reward_timeout`), counted and logged once per batch (see `vlmrl.rewards.base` for what a reward function is).
With reward.judge.enable a judge model scores every response too, and the reward is (1 - weight) * rule +
weight * judge (`vlmrl.rewards.judge`; a sample the judge fails on is flagged and counted as a failure too).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlmrl.rewards.base import FAILED_KEY, TIMEOUT_KEY, Outcome, RewardFn, RewardInput, score_one
from vlmrl.rewards.registry import get_reward_fn
from vlmrl.rewards.workers import RewardWorkers

if TYPE_CHECKING:  # scoring imports no torch: reward worker processes import this package
    from vlmrl.rewards.config import RewardConfig
    from vlmrl.rewards.judge import Judge
    from vlmrl.types import RolloutRequest, RolloutResult

logger = logging.getLogger(__name__)


@dataclass
class Scores:
    """The rewards of a batch of responses, request-major (n per request) like the responses they score."""

    values: list[float]
    """Each response's score; 0.0 where the reward function failed."""
    parts: list[dict[str, float]]
    """Each response's named reward parts plus `reward_failed` (and `reward_timeout` under a time limit)."""
    failures: int
    """Responses whose reward function failed or overran reward.timeout_s (timeouts included), or that the judge
    failed to score."""


class RewardScorer:
    """A run's reward: its function (reward.function) and what scoring with it holds open, the reward worker
    processes (reward.timeout_s) and the judge (reward.judge, with the server vlmrl launched for it). A part of the
    run like its engine: built with the run's other parts, closed with them (`close`, safe to call twice), and never
    shared: two runs in one process have two. A closed scorer refuses to score."""

    def __init__(self, config: RewardConfig, fn: RewardFn, workers: RewardWorkers | None = None,
                 judge: Judge | None = None):
        self.config, self.fn = config, fn
        self.workers = workers
        """The worker processes scoring under reward.timeout_s; None when the function runs in this process."""
        self.judge = judge
        """The judge (reward.judge.enable); None without one."""
        self.closed = False

    @classmethod
    def start(cls, config: RewardConfig, data_sources: Iterable[str]) -> RewardScorer:
        """The run's reward for reward.function. With reward.timeout_s its worker processes start now, so a function
        that cannot run in a worker stops the run here rather than after the first rollout; with reward.judge.enable
        the judge starts now too (its server launched, or the given URL checked to answer), so an unusable judge
        stops the run before training. What started before a failure is closed before the error goes on."""
        scorer = cls(config, get_reward_fn(config.function, data_sources))
        try:
            if config.timeout_s:
                scorer.workers = RewardWorkers(scorer.fn, config.num_workers)
            if config.judge.enable:
                from vlmrl.rewards.judge import start_judge

                scorer.judge = start_judge(config.judge)
        except BaseException:
            scorer.close()
            raise
        return scorer

    def score(self, requests: Sequence[RolloutRequest], texts: Sequence[str], n: int) -> Scores:
        """`score_texts` with this run's function, workers and judge."""
        if self.closed:
            raise RuntimeError("the run's reward is closed (its run has ended): it scores only while the run is open")
        return score_texts(self.fn, requests, texts, n, self.config, workers=self.workers, judge=self.judge)

    def close(self) -> None:
        """Kills the reward workers and closes the judge (ending the server vlmrl launched for it): both, even when
        the first fails."""
        self.closed = True
        try:
            if self.workers is not None:
                self.workers.close()
        finally:
            if self.judge is not None:
                self.judge.close()


def response_texts(tokenizer, results: Sequence[RolloutResult]) -> list[str]:
    """What a reward function reads of each result: its response decoded with special tokens skipped (as verl does).
    `tokenizer` is the processor's (a transformers tokenizer)."""
    return tokenizer.batch_decode([r.response_ids for r in results], skip_special_tokens=True)


def score_texts(reward_fn: RewardFn, requests: Sequence[RolloutRequest], texts: Sequence[str], n: int,
                config: RewardConfig, *, workers: RewardWorkers | None = None, judge: Judge | None = None) -> Scores:
    """Score every response text (request-major, n per request) against its request's data_source, ground truth and
    extra_info. A failing reward function, or one overrunning reward.timeout_s (in `workers`, which a limit needs),
    scores 0 with `reward_failed = 1` and the run goes on (`compute_rewards`). With reward.judge.enable `judge`
    scores them too and the two combine (`vlmrl.rewards.judge.combine`: parts rule, judge, judge_failed,
    judge_cached). A run scores through its `RewardScorer`, which holds both."""
    if len(texts) != n * len(requests):
        raise ValueError(f"{len(texts)} responses for {len(requests)} requests x n={n}: scoring needs n per request")
    if config.judge.enable and judge is None:
        raise ValueError("reward.judge.enable needs the judge to score with: start the run's reward with "
                         "RewardScorer.start, which starts it")
    items = [RewardInput.from_request(requests[i // n], text) for i, text in enumerate(texts)]
    values, parts, failures = compute_rewards(reward_fn, items, timeout_s=config.timeout_s, workers=workers)
    if config.judge.enable:
        from vlmrl.rewards.judge import combine

        verdicts = judge.score(requests, texts, n)
        values, parts = combine(values, parts, verdicts, n, config.judge.weight)
        failures = sum(part[FAILED_KEY] > 0 for part in parts)
    return Scores(values, parts, failures)


def compute_rewards(fn: RewardFn, items: Sequence[RewardInput], timeout_s: float | None = None,
                    workers: RewardWorkers | None = None) -> tuple[list[float], list[dict[str, float]], int]:
    """Scores every item with `fn`: (scores, extras, failure_count).

    extras[i] holds item i's named parts plus `reward_failed` (0.0 or 1.0), and `reward_timeout` (0.0 or 1.0) when
    there is a limit. A failed item scores 0.0 and its parts are 0.0 under the names the other items of the batch
    used, so every item has the same keys for the metrics. The first failure and the first timeout are logged with
    their sample; the count of all of them follows. failure_count includes the timeouts.

    Args:
        timeout_s: per-sample limit in seconds; None or <= 0 scores here, in this process, with no limit.
        workers: the worker processes that score under a limit (`vlmrl.rewards.workers`), started for `fn` by
            their owner; a limit needs them.
    """
    limited = timeout_s is not None and timeout_s > 0
    if not items:
        return [], [], 0
    if limited:
        if workers is None or workers.fn != fn:
            raise ValueError(f"reward.timeout_s={timeout_s:g} scores in worker processes: pass the RewardWorkers "
                             f"started for {getattr(fn, '__name__', fn)} (a run's RewardScorer holds them)")
        outcomes = workers.score(items, timeout_s)
    else:
        outcomes = [score_one(fn, item) for item in items]
    part_names = sorted({name for out in outcomes if out.output is not None for name in out.output.parts})
    scores, extras = [], []
    for out in outcomes:
        flags = {FAILED_KEY: float(out.output is None)}
        if limited:
            flags[TIMEOUT_KEY] = float(out.timed_out)
        if out.output is None:
            scores.append(0.0)
            extras.append({**dict.fromkeys(part_names, 0.0), **flags})
        else:
            scores.append(out.output.score)
            extras.append({**out.output.parts, **flags})
    _log_failures(fn, items, outcomes, timeout_s)
    return scores, extras, sum(out.output is None for out in outcomes)


def _log_failures(fn: RewardFn, items: Sequence[RewardInput], outcomes: Sequence[Outcome],
                  timeout_s: float | None) -> None:
    """One warning per kind (timeout, other failure) per batch, with the first such sample and the count."""
    name = getattr(fn, "__name__", fn)
    timed_out = [i for i, out in enumerate(outcomes) if out.timed_out]
    failed = [i for i, out in enumerate(outcomes) if out.output is None and not out.timed_out]
    if timed_out:
        logger.warning("reward function %s took longer than reward.timeout_s=%g s on %d of %d samples: they were "
                       "stopped and score 0 (flags %s, %s). First one, %s", name, timeout_s, len(timed_out),
                       len(items), FAILED_KEY, TIMEOUT_KEY, _describe(timed_out[0], items[timed_out[0]]))
    if failed:
        logger.warning("reward function %s failed on %d of %d samples; they score 0 (flag %s). First failure, %s\n%s",
                       name, len(failed), len(items), FAILED_KEY, _describe(failed[0], items[failed[0]]),
                       outcomes[failed[0]].error.rstrip())


def _describe(position: int, item: RewardInput) -> str:
    return (f"sample {position}: data_source={item.data_source!r} ground_truth={item.ground_truth!r} "
            f"extra_info={item.extra_info!r} response={item.response[:1000]!r}")
