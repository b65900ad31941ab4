"""One sample's diff: a pair of records (same row, same sample index) at all four levels (inputs, tokens, logprobs,
rewards) and the one cause that explains it, the earliest level that does (`classify`). What the two artifacts'
headers say (other weights, other dtypes, processed logprobs) can explain a sample too (`Headers`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vlmrl.alignment.artifact import ArtifactMeta, ValidationRecord
from vlmrl.alignment.causes import Cause, Thresholds
from vlmrl.alignment.divergence import (
    Divergence,
    TextWindow,
    judge_divergence,
    logprob_deltas,
    tempered_delta,
    text_window,
)
from vlmrl.alignment.inputs import diff_inputs, first_difference
from vlmrl.alignment.precision import FP32_THRESHOLDS


@dataclass
class SampleDiff:
    """Everything the report says about one sample (same dataset row and sample index on both sides)."""

    index: int
    sample_index: int
    uid: str
    data_source: str
    input_diffs: list[str]
    """Human-readable input differences, empty when the inputs are identical."""
    tokens_equal: bool
    length_a: int
    length_b: int
    finish_a: str
    finish_b: str
    compared_positions: int
    """Common-prefix positions whose logprobs were compared."""
    max_abs_logprob_delta: float | None
    mean_abs_logprob_delta: float | None
    reward_a: float
    reward_b: float
    reward_extra_deltas: dict[str, float]
    divergence: Divergence | None = None
    text: TextWindow | None = None
    tempered_max_delta: float | None = None
    """max |logprob - the other side's tempered logprob| when a side recorded `tempered_logprobs` (the trainer side,
    of the distribution the engine sampled from); None otherwise."""
    routing: Any = None
    """`vlmrl.alignment.routing.RoutingAgreement` over the tokens before the gap, when both sides recorded routing
    and it differs there; None otherwise."""
    cause: Cause | None = None
    explanation: str = ""

    @property
    def reward_delta(self) -> float:
        return self.reward_b - self.reward_a


@dataclass(frozen=True)
class Headers:
    """What the two artifacts' headers say that can explain a sample's difference, in words ("" = nothing)."""

    weights: str = ""
    """How the sides' weight fingerprints differ (`weights_difference`)."""
    dtypes: str = ""
    """How the sides' dtypes differ (`dtype_difference`)."""
    processed: str = ""
    """Which side's engine returned processed logprobs (`processed_sides`)."""


def classify(sample: SampleDiff, greedy: bool, rewards_differ: bool, thresholds: Thresholds,
              headers: Headers = Headers()) -> tuple[Cause | None, str]:
    """One cause per differing sample: the earliest level that explains the difference."""
    if sample.input_diffs:
        return Cause.INPUT_MISMATCH, "; ".join(sample.input_diffs)
    if headers.weights:
        cause, explanation = classify(sample, greedy, rewards_differ, thresholds, replace(headers, weights=""))
        if cause is not None:
            return Cause.WEIGHTS_DIFFER, f"{headers.weights}; {explanation}"
    split = sample.divergence
    outputs_differ = not sample.tokens_equal or sample.finish_a != sample.finish_b
    if outputs_differ and not greedy:
        return None, "sampled decoding: different tokens are expected; compared statistically only"
    if split is not None:
        where = (f"token {split.position}: A chose {split.token_a} ({split.logprob_a:.4f}), "
                 f"B chose {split.token_b} ({split.logprob_b:.4f})")
        if split.b_in_top_a is None or split.a_in_top_b is None:
            return Cause.UNCLASSIFIED_DIVERGENCE, f"{where}; no top-k logprobs to judge it"
        margin = split.margin_a + split.margin_b if split.b_in_top_a and split.a_in_top_b else None
        if margin is not None and margin <= thresholds.near_tie_margin:
            return Cause.NEAR_TIE, f"{where}; each in the other's top-k, margins add to {margin:.4f} nats"
        if sample.routing is not None:  # a wide margin, or a token outside the other's top-k, after other experts
            return Cause.ROUTING, f"{where}; before it, {sample.routing.describe()}"
        if margin is not None:
            return Cause.REAL_DIVERGENCE, f"{where}; in each other's top-k but margins add to {margin:.3f} nats"
        missing = " and ".join(side for side, ok in (("B's token not in A's top-k", split.b_in_top_a),
                                                      ("A's token not in B's top-k", split.a_in_top_b)) if not ok)
        return Cause.REAL_DIVERGENCE, f"{where}; {missing}"
    if outputs_differ:
        return Cause.LENGTH_OR_FINISH, (
            f"same tokens up to {min(sample.length_a, sample.length_b)}; lengths {sample.length_a} vs "
            f"{sample.length_b}, finish {sample.finish_a} vs {sample.finish_b}")
    if rewards_differ:
        parts = ", ".join(f"{k} {v:+.3g}" for k, v in sample.reward_extra_deltas.items() if v)
        return Cause.REWARD_DISAGREEMENT, (
            f"identical response scored {sample.reward_a:.4g} vs {sample.reward_b:.4g}"
            + (f" ({parts})" if parts else ""))
    drift = sample.max_abs_logprob_delta
    beyond = drift is not None and not drift <= thresholds.drift_tolerance  # `not <=` also catches NaN
    tempered = sample.tempered_max_delta
    if beyond and tempered is not None and tempered <= thresholds.drift_tolerance:
        return Cause.PROCESSED_LOGPROBS, (
            f"same {sample.length_a} tokens; logprobs differ by up to {drift:.4g} nats from the raw model's but by "
            f"at most {tempered:.4g} from the distribution it sampled (softmax(logits / temperature) over the "
            "allowed tokens, after top-k/top-p): that side returned processed logprobs")
    if beyond and tempered is None and headers.processed:
        return Cause.PROCESSED_LOGPROBS, (
            f"same {sample.length_a} tokens, logprobs up to {drift:.4g} nats apart: {headers.processed}, so they are "
            "of the distribution it sampled (temperature, the placeholder ban, top-k/top-p), not the raw model's")
    if beyond and sample.routing is not None:
        return Cause.ROUTING, (f"same {sample.length_a} tokens, logprobs up to {drift:.4g} nats apart; before the "
                               f"largest gap, {sample.routing.describe()}")
    if beyond:
        return Cause.LOGPROB_DRIFT, (
            f"same {sample.length_a} tokens, but logprobs differ by up to {drift:.4g} nats (mean "
            f"{sample.mean_abs_logprob_delta:.4g})" + (f"; {headers.processed}, yet they are {tempered:.4g} nats from "
                                                      "the distribution it sampled too" if headers.processed else ""))
    if headers.dtypes and drift is not None and drift > FP32_THRESHOLDS["drift_tolerance"]:
        return Cause.PRECISION, (f"same {sample.length_a} tokens, logprobs up to {drift:.4g} nats apart: within the "
                                 f"{thresholds.drift_tolerance:g}-nat band of {headers.dtypes}")
    return None, ""


def numeric_parts(extra: dict[str, Any]) -> dict[str, float]:
    """The numeric parts of reward_extra (accuracy, format, flags as 0/1); strings and lists are not compared."""
    return {k: float(v) for k, v in extra.items() if isinstance(v, (int, float))}


def diff_sample(a: ValidationRecord, b: ValidationRecord, greedy: bool, thresholds: Thresholds,
                headers: Headers = Headers()) -> SampleDiff:
    """All four levels for one pair of records (same row, same sample index)."""
    split_at = first_difference(a.response_ids, b.response_ids)
    common = split_at if split_at is not None else len(a.response_ids)
    deltas = logprob_deltas(a, b, common)
    parts_a, parts_b = numeric_parts(a.reward_extra), numeric_parts(b.reward_extra)
    extra_deltas = {k: parts_b[k] - parts_a[k] for k in sorted(parts_a.keys() & parts_b.keys())}
    sample = SampleDiff(
        index=a.index, sample_index=a.sample_index, uid=a.uid, data_source=a.data_source,
        input_diffs=diff_inputs(a, b), tokens_equal=split_at is None,
        length_a=len(a.response_ids), length_b=len(b.response_ids), finish_a=a.finish_reason, finish_b=b.finish_reason,
        compared_positions=common,
        max_abs_logprob_delta=float(deltas.max()) if common else None,
        mean_abs_logprob_delta=float(deltas.mean()) if common else None,
        reward_a=float(a.reward), reward_b=float(b.reward), reward_extra_deltas=extra_deltas,
        text=text_window(a.response_text, b.response_text),
    )
    if split_at is not None and split_at < min(len(a.response_ids), len(b.response_ids)):
        sample.divergence = judge_divergence(a, b, split_at)
    sample.tempered_max_delta = tempered_delta(a, b, common)
    if a.routing is not None and b.routing is not None:
        from vlmrl.alignment.routing import routing_before

        # the logit of response token j sits at expanded position P - 1 + j and depends on every token up to it
        gap_at = split_at if sample.divergence is not None else (int(np.argmax(deltas)) if common else None)
        if gap_at is not None:
            sample.routing = routing_before(a.routing, b.routing, a.expanded_prompt_length - 1 + gap_at)
    rewards_differ = abs(sample.reward_delta) > thresholds.reward_tolerance or any(
        abs(v) > thresholds.reward_tolerance for v in extra_deltas.values()) or parts_a.keys() != parts_b.keys()
    sample.cause, sample.explanation = classify(sample, greedy, rewards_differ, thresholds, headers)
    return sample


def weights_difference(meta_a: ArtifactMeta, meta_b: ArtifactMeta) -> str:
    """In words, how the two sides' weight fingerprints differ; "" when they agree or a side did not record one."""
    if meta_a.weights and meta_b.weights and meta_a.weights != meta_b.weights:
        return f"the sides loaded other weights (sha256 {meta_a.weights[:12]} vs {meta_b.weights[:12]})"
    return ""


def processed_sides(meta_a: ArtifactMeta, meta_b: ArtifactMeta, labels: tuple[str, str]) -> str:
    """In words, which side's header says its engine returned processed logprobs; "" when none does (or the
    artifacts predate the header's `logprobs_mode`)."""
    named = [f"{label}'s engine ran with logprobs_mode={meta.logprobs_mode}" for label, meta in zip(labels, (meta_a,
             meta_b)) if meta.logprobs_mode.startswith("processed")]
    return " and ".join(named)
