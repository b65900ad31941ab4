"""Scoring a batch of responses: what a reward function receives and returns, and how failures are contained.

Every reward function has verl's signature, so a verl `compute_score` works unchanged::

    def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None)
        -> float | dict   # a dict holds the score under "score" (verl) or "overall" (EasyR1), plus named parts

It is called with keyword arguments. Numeric dict entries besides the score (accuracy, format...) are named parts,
logged apart; other entries (e.g. the extracted answer as a string) are ignored. A function that raises, or returns
NaN, infinity or something that is not a number, fails that one sample: it scores 0, is flagged with
`reward_failed = 1.0`, is counted, and the run goes on.

Batches are scored by `vlmrl.rewards.scoring.compute_rewards`. With a time limit (`timeout_s`, the config's
`reward.timeout_s`) the function runs in worker processes (`vlmrl.rewards.workers`): a sample that takes longer is
stopped by killing its worker, scores 0 and is flagged with both `reward_failed = 1.0` and `reward_timeout = 1.0`.
Without one it runs here, in this process, with no limit.
"""

from __future__ import annotations

import math
import numbers
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # scoring needs no torch
    from vlmrl.types import RolloutRequest

RewardFn = Callable[..., Any]
"""`fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...) -> float | dict | RewardOutput`."""

FAILED_KEY = "reward_failed"
"""Part set to 1.0 on a sample whose reward function failed (0.0 otherwise): its mean is the failure rate."""
TIMEOUT_KEY = "reward_timeout"
"""Part set to 1.0 on a sample whose scoring overran the time limit (those are failures too), 0.0 otherwise; present
only when scoring has a limit. Its mean is the timeout rate."""


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
        return cls(request.data_source, response, request.ground_truth, dict(request.extra_info))  # a copy per response


@dataclass
class RewardOutput:
    """A score and its named parts (e.g. geo3k: score = 0.9 * accuracy + 0.1 * format)."""

    score: float
    parts: dict[str, float] = field(default_factory=dict)


class RewardValueError(ValueError):
    """A reward function returned something that is not a finite score."""


def require_ground_truth(ground_truth: Any) -> Any:
    """`ground_truth`, or a ValueError (a counted reward failure) when the row has none: a grader comparing with
    str(None) would score the answer "None" right."""
    if ground_truth is None:
        raise ValueError("the sample has no ground truth (reward_model.ground_truth / answer): it cannot be graded")
    return ground_truth


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


@dataclass
class Outcome:
    """How scoring one sample went: its output, or why there is none."""

    output: RewardOutput | None
    error: str = ""
    """The traceback (or reason) when there is no output."""
    timed_out: bool = False


def score_one(fn: RewardFn, item: RewardInput) -> Outcome:
    """Calls `fn` on one item (here or in a worker process); an exception, SystemExit included, becomes a failed
    Outcome (KeyboardInterrupt goes on: it stops the run).

    >>> score_one(lambda **kw: {"score": 1, "acc": 1.0}, RewardInput("s", "a", "a")).output
    RewardOutput(score=1.0, parts={'acc': 1.0})
    >>> score_one(lambda **kw: 1 / 0, RewardInput("s", "a", "a")).error.splitlines()[-1]
    'ZeroDivisionError: division by zero'
    """
    try:
        return Outcome(to_output(fn(data_source=item.data_source, solution_str=item.response,
                                    ground_truth=item.ground_truth, extra_info=item.extra_info)))
    except KeyboardInterrupt:  # Ctrl-C stops the run (a reward raising it itself cannot be told apart)
        raise
    except BaseException as err:  # a broken reward must not stop a long run, not even by sys.exit(): it scores 0
        return Outcome(None, "".join(traceback.format_exception(err)))
