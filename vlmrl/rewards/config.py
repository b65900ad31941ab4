"""Reward configuration: which function scores responses and how it runs (the run config's `reward` section)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RewardConfig:
    function: str = ""
    """Reward: empty = chosen per row by data_source (geo3k, synthetic), a built-in name, or `path/to/file.py:fn`."""
    timeout_s: float | None = 10.0
    """Most seconds the reward function may take on one sample. A sample that takes longer is stopped (its worker
    process is killed and replaced), scores 0 and is flagged reward_failed=1 and reward_timeout=1 (metrics
    reward/timeouts, val/reward_timeouts); the run goes on. With a limit the function runs in reward.num_workers worker
    processes, so it must be defined at module level (built-ins, `path/to/file.py:fn` and `package.module:fn` are),
    and module-level state in it is per worker. 0 or null: no limit, scored in the trainer's process."""
    num_workers: int = 1
    """Worker processes scoring under reward.timeout_s; each gets one contiguous share of every batch. More
    score a batch in parallel (slow graders such as sympy-based ones)."""

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        if self.timeout_s is not None and self.timeout_s < 0:
            out.append(f"reward.timeout_s={self.timeout_s} must be >= 0 (0 or null = no limit, scored in this process)")
        if self.num_workers < 1:
            out.append(f"reward.num_workers={self.num_workers} must be >= 1")
        return out
