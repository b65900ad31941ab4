"""Rewards: geo3k (mathruler), the synthetic tasks, user functions as `path/to/file.py:function`, and batch scoring
that contains failures (a failing sample scores 0 with `reward_failed = 1.0`; the run goes on)."""

from vlmrl.rewards.base import FAILED_KEY, RewardFn, RewardInput, RewardOutput, compute_rewards, to_output
from vlmrl.rewards.registry import BUILTINS, builtin_for, get_reward_fn, load_user_fn

__all__ = [
    "BUILTINS",
    "FAILED_KEY",
    "RewardFn",
    "RewardInput",
    "RewardOutput",
    "builtin_for",
    "compute_rewards",
    "get_reward_fn",
    "load_user_fn",
    "to_output",
]
