"""Rewards: geo3k (mathruler), the synthetic tasks, user functions as `path/to/file.py:function`, and batch scoring
(`score_texts`: request-major responses against their requests) that contains failures (a failing sample scores 0
with `reward_failed = 1.0`; the run goes on) and, with a time limit, hangs (worker processes; an overrunning sample
is stopped and also flagged `reward_timeout = 1.0`)."""

from vlmrl.rewards.base import (
    FAILED_KEY,
    TIMEOUT_KEY,
    RewardFn,
    RewardInput,
    RewardOutput,
    to_output,
)
from vlmrl.rewards.registry import BUILTINS, builtin_for, get_reward_fn, load_user_fn
from vlmrl.rewards.scoring import Scores, compute_rewards, load_reward_fn, response_texts, score_texts
from vlmrl.rewards.workers import close_reward_workers, workers_for

__all__ = [
    "BUILTINS",
    "FAILED_KEY",
    "TIMEOUT_KEY",
    "RewardFn",
    "RewardInput",
    "RewardOutput",
    "Scores",
    "builtin_for",
    "close_reward_workers",
    "compute_rewards",
    "get_reward_fn",
    "load_reward_fn",
    "load_user_fn",
    "response_texts",
    "score_texts",
    "to_output",
    "workers_for",
]
