"""Why two sides' sample differs: the causes a diff names (one per differing sample, the earliest level that explains
it), their labels, and the thresholds that judge them (when two backends count as aligned).

The causes are assigned by `vlmrl.alignment.sample_diff.classify`; the gate that counts them against the thresholds
is `vlmrl.alignment.diff.evaluate_checks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Cause(str, Enum):
    """Why a sample differs between the two sides (one per differing sample, earliest level first)."""

    INPUT_MISMATCH = "input_mismatch"
    """The model saw different inputs (prompt ids, image bytes/size/grid): fix preprocessing before anything else."""
    WEIGHTS_DIFFER = "weights_differ"
    """The two sides loaded other weight files (their headers' `weights` fingerprints differ) and this sample's
    outputs or logprobs differ: load the same checkpoint on both sides before reading anything else."""
    NEAR_TIE = "near_tie"
    """Greedy outputs split where the top two tokens were within numerical noise: expected across kernels/dtypes."""
    REAL_DIVERGENCE = "real_divergence"
    """Outputs split where one side's token was clearly not what the other would pick: the models compute
    differently."""
    UNCLASSIFIED_DIVERGENCE = "divergence_without_topk"
    """Outputs split but an artifact has no top-k logprobs there, so near-tie vs real cannot be told."""
    LENGTH_OR_FINISH = "length_or_finish"
    """Same tokens where both have them; only the length or finish reason differs (max_new_tokens, abort)."""
    REWARD_DISAGREEMENT = "reward_disagreement"
    """Identical responses scored differently: the reward functions (or their versions/settings) disagree."""
    LOGPROB_DRIFT = "logprob_drift"
    """Identical responses, but some token's logprob differs by more than `Thresholds.drift_tolerance`: the models
    compute differently even where they agree on every token (other weights, dtype, kernels)."""
    PRECISION = "precision"
    """Identical responses whose logprobs differ by more than float32 rounding but within the lower-precision band
    (`Thresholds.drift_tolerance`), on sides that computed in different dtypes (a bfloat16 trainer against a
    float32 engine): expected, and allowed by default."""
    ROUTING = "routing"
    """A MoE model whose sides routed some token before the gap (the split, or the token whose logprob differs most)
    through other experts (both artifacts recorded their routing): the largest train/inference mismatch a MoE
    model adds, what routing replay (actor.moe.routing_replay) removes from the update. The explanation names the
    first such token and the first MoE layer whose routing differs."""
    PROCESSED_LOGPROBS = "processed_logprobs"
    """Identical responses whose logprobs on one side are of the distribution that side sampled from, not the raw
    model's: they match the trainer's `tempered_logprobs` (softmax(logits / T) over the tokens the request allows,
    after top-k/top-p), or the side's header says its engine ran with vLLM's logprobs_mode=processed_logprobs. Every
    importance ratio computed from them is off by that processing."""


CAUSE_LABELS = {
    Cause.INPUT_MISMATCH: "input mismatch",
    Cause.WEIGHTS_DIFFER: "other weights",
    Cause.NEAR_TIE: "numerical near-tie",
    Cause.REAL_DIVERGENCE: "real divergence",
    Cause.UNCLASSIFIED_DIVERGENCE: "divergence (no top-k to judge)",
    Cause.LENGTH_OR_FINISH: "length / finish reason only",
    Cause.REWARD_DISAGREEMENT: "reward disagreement on equal text",
    Cause.LOGPROB_DRIFT: "logprob drift on equal tokens",
    Cause.PROCESSED_LOGPROBS: "temperature-processed logprobs",
    Cause.ROUTING: "MoE routing",
    Cause.PRECISION: "precision (dtype band)",
}


@dataclass
class Thresholds:
    """When two backends count as aligned (compare exits 0). Fractions are of all compared samples."""

    max_input_mismatch: float = 0.0
    """Largest allowed fraction of samples whose inputs differ."""
    max_weights_differ: float = 0.0
    """Largest allowed fraction of differing samples on sides that loaded other weight files."""
    max_real_divergence: float = 0.0
    """Largest allowed fraction of real divergences."""
    max_unclassified_divergence: float = 0.0
    """Largest allowed fraction of divergences that cannot be judged (no top-k logprobs in an artifact)."""
    max_near_tie: float = 1.0
    """Largest allowed fraction of near-ties (numerical noise; 1.0 = never fails on near-ties alone)."""
    max_length_or_finish: float = 0.0
    """Largest allowed fraction of length/finish-reason-only differences."""
    max_reward_disagreement: float = 0.0
    """Largest allowed fraction of equal responses scored differently."""
    max_logprob_drift: float = 1.0
    """Largest allowed fraction of equal responses with logprob drift (1.0 = the mean delta below gates instead)."""
    max_precision: float = 1.0
    """Largest allowed fraction of samples whose logprobs differ within the dtype band (1.0 = expected)."""
    max_processed_logprobs: float = 0.0
    """Largest allowed fraction of samples whose logprobs are temperature-processed on one side."""
    max_routing: float = 1.0
    """Largest allowed fraction of samples whose gap follows tokens routed through other experts (1.0 = reported,
    never failing: in bfloat16 a MoE model's routing flips at near-tied routers by design)."""
    drift_tolerance: float = 0.1
    """Per-token |logprob delta| (nats) above which an otherwise identical sample counts as logprob drift."""
    max_mean_logprob_delta: float = 0.05
    """Largest allowed mean |logprob_a - logprob_b| over all common-prefix tokens (nats)."""
    near_tie_margin: float = 0.5
    """A split is a near-tie only if both tokens are in each other's top-k and the two sides' preference margins
    (lp_a[a] - lp_a[b]) + (lp_b[b] - lp_b[a]) add up to at most this many nats."""
    max_score_delta: float = 0.01
    """Fails only when a score difference is larger than this AND significant at `alpha` (overall and per source)."""
    alpha: float = 0.05
    """Significance level of the paired test."""
    reward_tolerance: float = 1e-6
    """Rewards closer than this count as equal."""
