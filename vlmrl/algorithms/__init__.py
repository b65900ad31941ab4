"""GRPO algorithms: pure tensor math (advantages, PPO-clip loss, KL estimators, entropy)."""

from vlmrl.algorithms.grpo import (
    KL_TYPES,
    PolicyLoss,
    broadcast_to_tokens,
    entropy_from_logits,
    group_advantages,
    kl_penalty,
    logprobs_from_logits,
    ppo_clip_loss,
    token_mean,
)

__all__ = [
    "KL_TYPES", "PolicyLoss", "broadcast_to_tokens", "entropy_from_logits", "group_advantages", "kl_penalty",
    "logprobs_from_logits", "ppo_clip_loss", "token_mean",
]
