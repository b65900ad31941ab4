"""Scoring a batch of responses: what a reward function receives and returns, and how failures are contained.

Every reward function has verl's signature, so a verl `compute_score` works unchanged::

    def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None)
        -> float | dict   # a dict holds the score under "score" (verl) or "overall" (EasyR1), plus named parts

It is called with keyword arguments. Numeric dict entries besides the score (accuracy, format...) are named parts,
logged apart; other entries (e.g. the extracted answer as a string) are ignored. A function that raises, or returns
NaN, infinity or something that is not a number, fails that one sample: it scores 0, is flagged with
`reward_failed = 1.0`, is counted, and the run goes on.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # scoring needs no torch
    from vlmrl.types import RolloutRequest

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Any]
"""`fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...) -> float | dict | RewardOutput`."""

FAILED_KEY = "reward_failed"
"""Part set to 1.0 on a sample whose reward function failed (0.0 otherwise): its mean is the failure rate."""


@dataclass
class RewardInput:
    """One response to score (the trainer decodes the response ids with special tokens skipped, as verl does)."""

    data_source: str
    response: str
    """The decoded response: a reward function receives it as `solution_str`."""
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_request(cls, request: RolloutRequest, response: str) -> RewardInput:
        """The reward input of one response to a request (its row's data_source, ground truth and extra_info)."""
        return cls(request.data_source, response, request.ground_truth, request.extra_info)


@dataclass
class RewardOutput:
    """A score and its named parts (e.g. geo3k: score = 0.9 * accuracy + 0.1 * format)."""

    score: float
    parts: dict[str, float] = field(default_factory=dict)


class RewardValueError(ValueError):
    """A reward function returned something that is not a finite score."""


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # numpy / torch scalars
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise RewardValueError(f"{what} is {type(value).__name__} {value!r}, not a number")
    if not math.isfinite(value):
        raise RewardValueError(f"{what} is {value}")
    return float(value)


def to_output(value: Any) -> RewardOutput:
    """A reward function's return value as a RewardOutput; raises RewardValueError when it is not a finite score.

    >>> to_output(1)
    RewardOutput(score=1.0, parts={})
    >>> to_output({"score": 0.9, "acc": True, "pred": "4"})
    RewardOutput(score=0.9, parts={'acc': 1.0})
    >>> to_output(float("nan"))
    Traceback (most recent call last):
    ...
    vlmrl.rewards.base.RewardValueError: score is nan
    """
    if isinstance(value, RewardOutput):
        return RewardOutput(_finite(value.score, "score"),
                            {k: _finite(v, f"part {k!r}") for k, v in value.parts.items()})
    if isinstance(value, dict):
        key = "score" if "score" in value else "overall" if "overall" in value else None
        if key is None:
            raise RewardValueError(f"dict without a 'score' (or 'overall') key: keys {sorted(value)}")
        parts = {k: _finite(v, f"part {k!r}") for k, v in value.items()
                 if k != key and (isinstance(v, (numbers.Real, bool)) or hasattr(v, "item"))}
        return RewardOutput(_finite(value[key], key), parts)
    return RewardOutput(_finite(value, "score"))


def compute_rewards(fn: RewardFn, items: Sequence[RewardInput]) -> tuple[list[float], list[dict[str, float]], int]:
    """Scores every item with `fn`: (scores, extras, failure_count).

    extras[i] holds item i's named parts plus `reward_failed` (0.0 or 1.0). A failed item scores 0.0 and its parts
    are 0.0 under the names the other items of the batch used, so every item has the same keys for the metrics.
    The first failure is logged with its sample and traceback; the count of all of them follows.
    """
    outputs: list[RewardOutput | None] = []
    first_failure: tuple[int, BaseException] | None = None
    for position, item in enumerate(items):
        try:
            outputs.append(to_output(fn(data_source=item.data_source, solution_str=item.response,
                                        ground_truth=item.ground_truth, extra_info=item.extra_info)))
        except Exception as err:  # a broken reward must not stop a long run: the sample scores 0, flagged
            outputs.append(None)
            first_failure = first_failure or (position, err)
    part_names = sorted({name for out in outputs if out is not None for name in out.parts})
    scores, extras = [], []
    for out in outputs:
        if out is None:
            scores.append(0.0)
            extras.append({**dict.fromkeys(part_names, 0.0), FAILED_KEY: 1.0})
        else:
            scores.append(out.score)
            extras.append({**out.parts, FAILED_KEY: 0.0})
    failures = sum(out is None for out in outputs)
    if first_failure is not None:
        position, err = first_failure
        item = items[position]
        logger.warning("reward function %s failed on %d of %d samples; they score 0 (flag %s). First failure, "
                       "sample %d: data_source=%r ground_truth=%r extra_info=%r response=%r",
                       getattr(fn, "__name__", fn), failures, len(items), FAILED_KEY, position, item.data_source,
                       item.ground_truth, item.extra_info, item.response[:1000], exc_info=err)
    return scores, extras, failures
