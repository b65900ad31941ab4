"""GRPO algorithms: pure tensor math (advantages, PPO-clip loss, KL estimators, entropy)."""

from importlib import import_module

# Imported on first use: the run config reads this package's config module and must not import torch.
_LAZY = {
    "KL_TYPES": "config",
    "PolicyLoss": "grpo",
    "broadcast_to_tokens": "grpo",
    "entropy_from_logits": "grpo",
    "group_advantages": "grpo",
    "kl_penalty": "grpo",
    "logprobs_from_logits": "grpo",
    "ppo_clip_loss": "grpo",
    "token_mean": "grpo",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"vlmrl.algorithms.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'vlmrl.algorithms' has no attribute {name!r}")


__all__ = sorted(_LAZY)
