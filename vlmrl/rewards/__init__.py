"""Rewards: geo3k (mathruler), the synthetic tasks, user functions as `path/to/file.py:function` (`registry`), and
batch scoring (`scoring.RewardScorer`, a run's reward: request-major responses against their requests) that contains
failures (a failing sample scores 0 with `reward_failed = 1.0`; the run goes on) and, with a time limit, hangs
(`workers`: worker processes; an overrunning sample is stopped and also flagged `reward_timeout = 1.0`). `judge`: a
model as the judge, over an OpenAI-compatible endpoint. The worker processes and the judge belong to the run's
`RewardScorer`, which the run closes."""
