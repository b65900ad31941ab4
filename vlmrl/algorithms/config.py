"""Algorithm configuration (the run config's `algorithm` section) and the names the GRPO math accepts.

Kept free of torch so that loading a run config does not import it; `vlmrl.algorithms.grpo` takes its KL names
from here.
"""

from __future__ import annotations

from dataclasses import dataclass

KL_TYPES = ("low_var_kl", "k1", "k2", "mse")
"""KL estimators of `vlmrl.algorithms.grpo.kl_penalty` (actor.kl_loss_type)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator; only grpo."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide group-centred rewards by the group std (GRPO); false = mean-centred only (Dr. GRPO)."""

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        if self.adv_estimator != "grpo":  # the loop runs GRPO only (vlmrl.algorithms has more estimators)
            return ["algorithm.adv_estimator must be `grpo` (the only estimator)"]
        return []
