"""RL algorithm math, pure tensor functions: advantage estimators, policy losses, loss aggregation, KL, entropy,
chunked response logprobs, rollout correction and DAPO's data helpers. The loop selects them by name (the *_FNS
registries and name tuples)."""

from vlmrl.utils.lazy import lazy_exports

# Imported on first use: the run config reads this package's config module and must not import torch.
_LAZY = {
    "ADV_ESTIMATOR_FNS": "advantages",
    "ADV_ESTIMATORS": "advantages",
    "compute_advantages": "advantages",
    "group_advantages": "advantages",
    "reinforce_plus_plus_advantages": "advantages",
    "reinforce_plus_plus_baseline_advantages": "advantages",
    "rloo_advantages": "advantages",
    "LOSS_AGG_MODES": "aggregation",
    "agg_loss": "aggregation",
    "loss_normaliser": "aggregation",
    "masked_sum": "aggregation",
    "token_mean": "aggregation",
    "KL_TYPES": "config",
    "ROLLOUT_CORRECTIONS": "correction",
    "RolloutCorrection": "correction",
    "rollout_correction": "correction",
    "groups_with_signal": "dapo",
    "mask_truncated": "dapo",
    "overlong_penalty": "dapo",
    "PolicyLoss": "grpo",
    "broadcast_to_tokens": "grpo",
    "entropy_from_logits": "grpo",
    "kl_penalty": "grpo",
    "logprobs_from_logits": "grpo",
    "ppo_clip_loss": "grpo",
    "logprobs_and_entropy": "logprobs",
    "POLICY_LOSS_FNS": "policy_loss",
    "POLICY_LOSSES": "policy_loss",
    "TokenLoss": "policy_loss",
    "cispo_token_loss": "policy_loss",
    "gspo_token_loss": "policy_loss",
    "ppo_clip_token_loss": "policy_loss",
    "sapo_gate": "policy_loss",
    "sapo_token_loss": "policy_loss",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = sorted(_LAZY)
