"""RL algorithm math, pure tensor functions: advantage estimators, policy losses, loss aggregation, KL, entropy,
rollout correction and DAPO's data helpers. The loop selects them by name (the *_FNS registries and name tuples)."""

from vlmrl.algorithms.advantages import (
    ADV_ESTIMATOR_FNS,
    ADV_ESTIMATORS,
    compute_advantages,
    group_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from vlmrl.algorithms.aggregation import LOSS_AGG_MODES, agg_loss, loss_normaliser, masked_sum, token_mean
from vlmrl.algorithms.dapo import groups_with_signal, mask_truncated, overlong_penalty
from vlmrl.algorithms.grpo import (
    KL_TYPES,
    PolicyLoss,
    broadcast_to_tokens,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    ppo_clip_loss,
)
from vlmrl.algorithms.policy_loss import (
    POLICY_LOSS_FNS,
    POLICY_LOSSES,
    TokenLoss,
    cispo_token_loss,
    gspo_token_loss,
    ppo_clip_token_loss,
)
from vlmrl.algorithms.correction import ROLLOUT_CORRECTIONS, RolloutCorrection, rollout_correction

__all__ = [
    "ADV_ESTIMATORS", "ADV_ESTIMATOR_FNS", "KL_TYPES", "LOSS_AGG_MODES", "POLICY_LOSSES", "POLICY_LOSS_FNS",
    "ROLLOUT_CORRECTIONS", "PolicyLoss", "RolloutCorrection", "TokenLoss", "agg_loss", "broadcast_to_tokens",
    "cispo_token_loss", "compute_advantages", "entropy_from_logits", "group_advantages", "groups_with_signal",
    "gspo_token_loss", "kl_penalty", "logprobs_from_logits", "loss_normaliser", "mask_truncated", "masked_sum",
    "overlong_penalty", "ppo_clip_loss", "ppo_clip_token_loss", "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages", "rloo_advantages", "rollout_correction", "token_mean",
]
