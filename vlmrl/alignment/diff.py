"""Where and why two validation artifacts differ: a pure diff at four levels, per sample and in aggregate.

Levels, in the order they explain each other:
  1. inputs   - prompt ids, expanded length, image hashes/sizes/grids. Any difference is reported first: every later
                difference may follow from it.
  2. tokens   - exact match, or the first divergence position with a window of text from both sides.
  3. logprobs - over the common prefix, max and mean |delta|; at the divergence, whether each side's token is in the
                other's top-k with a small margin (a numerical near-tie) or not (a real divergence). This is vLLM's
                divergence-aware rule: compare up to the first differing token, judge it there, then stop.
  4. rewards  - per-sample delta; per data source each side's score with an interval and a paired test.

Each differing sample gets exactly one cause (the earliest level that explains it), see `Cause`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np

from vlmrl.alignment.artifact import ArtifactMeta, ValidationRecord
from vlmrl.alignment.inputs import diff_inputs, first_difference
from vlmrl.alignment.precision import FP32_THRESHOLDS, Precision, dtype_difference, precision_of
from vlmrl.alignment.stats import PairedScore, paired_score

TEXT_WINDOW = 60
"""Characters of response text shown on each side of a divergence."""
OVERALL = "(all)"


class NotComparableError(ValueError):
    """The two artifacts cannot be compared sample by sample (other dataset, other rows). compare exits with 2."""


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


@dataclass
class Divergence:
    """The first response position where the two sides chose different tokens."""

    position: int
    token_a: int
    token_b: int
    logprob_a: float
    """Side A's logprob of its own token."""
    logprob_b: float
    b_in_top_a: bool | None
    """Whether B's token is in A's top-k there (None: A has no top-k)."""
    a_in_top_b: bool | None
    margin_a: float | None
    """lp_a[token_a] - lp_a[token_b]: how strongly A preferred its token (None when token_b is not in A's top-k)."""
    margin_b: float | None


@dataclass
class TextWindow:
    """The responses around the first character where their texts differ (for the terminal and HTML)."""

    position: int
    """Character offset of the first difference (== the common prefix length)."""
    before: str
    """Up to TEXT_WINDOW characters of the shared text right before it."""
    after_a: str
    after_b: str


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


@dataclass
class Check:
    """One threshold: its measured value, its limit, and whether it holds."""

    name: str
    value: float
    limit: float
    ok: bool
    detail: str = ""


@dataclass
class Comparison:
    """The whole diff of two artifacts; reports render it, `ok` sets the exit status."""

    meta_a: ArtifactMeta
    meta_b: ArtifactMeta
    label_a: str
    label_b: str
    greedy: bool
    """Both sides decoded greedily: tokens must match. Otherwise only inputs and scores are compared."""
    precision: Precision
    """The sides' dtypes and the threshold defaults they chose, with the reason."""
    thresholds: Thresholds
    """The thresholds the comparison was judged by."""
    setting_differences: list[tuple[str, Any, Any]]
    samples: list[SampleDiff]
    cause_counts: dict[Cause, int]
    exact: int
    """Samples with identical inputs, tokens, finish reason and reward, and logprobs within drift_tolerance."""
    max_abs_logprob_delta: float | None
    mean_abs_logprob_delta: float | None
    scores: dict[str, PairedScore]
    """Per data source, plus OVERALL."""
    reward_parts: dict[str, tuple[float, float]]
    """Mean of each numeric reward_extra part (accuracy, format...) on side A and side B."""
    checks: list[Check] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.samples)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def differing(self) -> list[SampleDiff]:
        return [sample for sample in self.samples if sample.cause is not None]


# ---------------------------------------------------------------------------------------------- comparability


def check_comparable(
    meta_a: ArtifactMeta, records_a: list[ValidationRecord], meta_b: ArtifactMeta, records_b: list[ValidationRecord]
) -> None:
    """Raise NotComparableError unless both artifacts validated the same data, row for row, sample for sample."""
    da, db = meta_a.dataset, meta_b.dataset
    if da.fingerprint != db.fingerprint or da.rows != db.rows:
        raise NotComparableError(
            f"the artifacts come from different datasets: A {da.paths} ({da.rows} rows, fingerprint "
            f"{da.fingerprint[:12]}) vs B {db.paths} ({db.rows} rows, fingerprint {db.fingerprint[:12]}); "
            "validate both backends on the same data"
        )
    keys_a = {(r.index, r.sample_index) for r in records_a}
    keys_b = {(r.index, r.sample_index) for r in records_b}
    if keys_a != keys_b:
        only_a, only_b = sorted(keys_a - keys_b), sorted(keys_b - keys_a)
        example = f"row {only_a[0][0]} sample {only_a[0][1]} only in A" if only_a else (
            f"row {only_b[0][0]} sample {only_b[0][1]} only in B")
        raise NotComparableError(
            f"the artifacts hold different samples ({len(records_a)} in A, {len(records_b)} in B; {example}); "
            "validate both sides with the same data.val_files, data.synthetic_val_size and rollout.val_n"
        )
    truth_a = {r.index: (r.data_source, r.ground_truth) for r in records_a}
    for record in records_b:
        if truth_a[record.index] != (record.data_source, record.ground_truth):
            raise NotComparableError(
                f"row {record.index} has data_source/ground truth {truth_a[record.index]!r} in A but "
                f"{(record.data_source, record.ground_truth)!r} in B: the rows are not the same"
            )


def _flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(config, dict):
        out: dict[str, Any] = {}
        for key, value in config.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): config}


def setting_differences(meta_a: ArtifactMeta, meta_b: ArtifactMeta) -> list[tuple[str, Any, Any]]:
    """(key, value in A, value in B) for every header setting that differs: model, engine, sampling, config."""
    a = {"backend": meta_a.backend, "engine": f"{meta_a.engine} {meta_a.engine_version}", "model_path":
         meta_a.model_path, "step": meta_a.step, "vlmrl_version": meta_a.vlmrl_version}
    b = {"backend": meta_b.backend, "engine": f"{meta_b.engine} {meta_b.engine_version}", "model_path":
         meta_b.model_path, "step": meta_b.step, "vlmrl_version": meta_b.vlmrl_version}
    a.update(_flatten(meta_a.sampling, "sampling."))
    b.update(_flatten(meta_b.sampling, "sampling."))
    a.update(_flatten(meta_a.config, "config."))
    b.update(_flatten(meta_b.config, "config."))
    missing = object()
    return [(key, a.get(key, missing), b.get(key, missing)) for key in sorted(a.keys() | b.keys())
            if a.get(key, missing) != b.get(key, missing)]


# ---------------------------------------------------------------------------------------------- per-sample levels


def _top_lookup(top: list[list[list[float]]] | None, position: int) -> dict[int, float] | None:
    """The top-k at `position` as {token: logprob}; None when not recorded, or when it holds fewer than 2 entries
    (a top-1 list is the side's own token: the other side's could never be found in it, which would judge every
    near-tie a real divergence)."""
    if top is None or position >= len(top) or top[position] is None or len(top[position]) < 2:
        return None
    return {int(token): float(logprob) for token, logprob in top[position]}


def judge_divergence(a: ValidationRecord, b: ValidationRecord, position: int) -> Divergence:
    """Level 3 at the split: is each side's token in the other's top-k, and by how much did each side prefer its own."""
    ta, tb = a.response_ids[position], b.response_ids[position]
    lpa, lpb = a.response_logprobs[position], b.response_logprobs[position]
    top_a, top_b = _top_lookup(a.top_logprobs, position), _top_lookup(b.top_logprobs, position)
    b_in_a = None if top_a is None else tb in top_a
    a_in_b = None if top_b is None else ta in top_b
    return Divergence(
        position=position, token_a=ta, token_b=tb, logprob_a=lpa, logprob_b=lpb,
        b_in_top_a=b_in_a, a_in_top_b=a_in_b,
        margin_a=lpa - top_a[tb] if b_in_a else None,
        margin_b=lpb - top_b[ta] if a_in_b else None,
    )


def text_window(text_a: str, text_b: str, width: int = TEXT_WINDOW) -> TextWindow | None:
    """The two texts around their first differing character; None when the texts are equal."""
    pos = first_difference(list(text_a), list(text_b))
    if pos is None:
        return None
    return TextWindow(pos, text_a[max(0, pos - width):pos], text_a[pos:pos + width], text_b[pos:pos + width])


def _logprob_deltas(a: ValidationRecord, b: ValidationRecord, upto: int) -> np.ndarray:
    """|lp_a - lp_b| over the first `upto` response positions, where both sides emitted the same tokens. (upto,)"""
    la = np.asarray(a.response_logprobs[:upto], dtype=np.float64)
    lb = np.asarray(b.response_logprobs[:upto], dtype=np.float64)
    deltas = np.abs(la - lb)
    # -inf on both sides (an impossible token both emitted) is agreement, not an infinite delta.
    return np.where(np.isneginf(la) & np.isneginf(lb), 0.0, deltas)


def _tempered_delta(a: ValidationRecord, b: ValidationRecord, upto: int) -> float | None:
    """max |one side's logprobs - the other side's tempered logprobs| over the first `upto` positions, for the side
    pair where one recorded `tempered_logprobs`; None when neither did (or nothing is compared)."""
    for raw, side in ((a, b), (b, a)):
        if side.tempered_logprobs is not None and upto:
            other = np.asarray(raw.response_logprobs[:upto], dtype=np.float64)
            return float(np.abs(other - np.asarray(side.tempered_logprobs[:upto], dtype=np.float64)).max())
    return None


@dataclass(frozen=True)
class Headers:
    """What the two artifacts' headers say that can explain a sample's difference, in words ("" = nothing)."""

    weights: str = ""
    """How the sides' weight fingerprints differ (`weights_difference`)."""
    dtypes: str = ""
    """How the sides' dtypes differ (`dtype_difference`)."""
    processed: str = ""
    """Which side's engine returned processed logprobs (`processed_sides`)."""


def _classify(sample: SampleDiff, greedy: bool, rewards_differ: bool, thresholds: Thresholds,
              headers: Headers = Headers()) -> tuple[Cause | None, str]:
    """One cause per differing sample: the earliest level that explains the difference."""
    if sample.input_diffs:
        return Cause.INPUT_MISMATCH, "; ".join(sample.input_diffs)
    if headers.weights:
        cause, explanation = _classify(sample, greedy, rewards_differ, thresholds, replace(headers, weights=""))
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


def _numeric_parts(extra: dict[str, Any]) -> dict[str, float]:
    """The numeric parts of reward_extra (accuracy, format, flags as 0/1); strings and lists are not compared."""
    return {k: float(v) for k, v in extra.items() if isinstance(v, (int, float))}


def diff_sample(a: ValidationRecord, b: ValidationRecord, greedy: bool, thresholds: Thresholds,
                headers: Headers = Headers()) -> SampleDiff:
    """All four levels for one pair of records (same row, same sample index)."""
    split_at = first_difference(a.response_ids, b.response_ids)
    common = split_at if split_at is not None else len(a.response_ids)
    deltas = _logprob_deltas(a, b, common)
    parts_a, parts_b = _numeric_parts(a.reward_extra), _numeric_parts(b.reward_extra)
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
    sample.tempered_max_delta = _tempered_delta(a, b, common)
    if a.routing is not None and b.routing is not None:
        from vlmrl.alignment.routing import routing_before

        # the logit of response token j sits at expanded position P - 1 + j and depends on every token up to it
        gap_at = split_at if sample.divergence is not None else (int(np.argmax(deltas)) if common else None)
        if gap_at is not None:
            sample.routing = routing_before(a.routing, b.routing, a.expanded_prompt_length - 1 + gap_at)
    rewards_differ = abs(sample.reward_delta) > thresholds.reward_tolerance or any(
        abs(v) > thresholds.reward_tolerance for v in extra_deltas.values()) or parts_a.keys() != parts_b.keys()
    sample.cause, sample.explanation = _classify(sample, greedy, rewards_differ, thresholds, headers)
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


# ---------------------------------------------------------------------------------------------- aggregate


def _row_scores(records: list[ValidationRecord]) -> dict[int, float]:
    """Mean reward over each row's samples (mean@n): rows, not samples, are the independent draws."""
    sums: dict[int, list[float]] = defaultdict(list)
    for record in records:
        sums[record.index].append(float(record.reward))
    return {index: float(np.mean(values)) for index, values in sums.items()}


def _scores(records_a: list[ValidationRecord], records_b: list[ValidationRecord]) -> dict[str, PairedScore]:
    rows_a, rows_b = _row_scores(records_a), _row_scores(records_b)
    source_of = {r.index: r.data_source for r in records_a}
    groups: dict[str, list[int]] = {OVERALL: sorted(rows_a)}
    for index in sorted(rows_a):
        groups.setdefault(source_of[index], []).append(index)
    if len(groups) == 2:  # one data source: its line would repeat the overall one
        groups = {OVERALL: groups[OVERALL]}
    return {name: paired_score(np.array([rows_a[i] for i in rows]), np.array([rows_b[i] for i in rows]))
            for name, rows in groups.items()}


def _reward_parts(records_a: list[ValidationRecord],
                  records_b: list[ValidationRecord]) -> dict[str, tuple[float, float]]:
    def means(records):
        values: dict[str, list[float]] = defaultdict(list)
        for record in records:
            for key, value in _numeric_parts(record.reward_extra).items():
                values[key].append(value)
        return {key: float(np.mean(v)) for key, v in values.items()}

    ma, mb = means(records_a), means(records_b)
    return {key: (ma[key], mb[key]) for key in sorted(ma.keys() & mb.keys())}


def evaluate_checks(comparison: Comparison, thresholds: Thresholds) -> list[Check]:
    """The gate: one Check per threshold."""
    total = max(comparison.total, 1)
    limits = {
        Cause.INPUT_MISMATCH: thresholds.max_input_mismatch,
        Cause.WEIGHTS_DIFFER: thresholds.max_weights_differ,
        Cause.REAL_DIVERGENCE: thresholds.max_real_divergence,
        Cause.UNCLASSIFIED_DIVERGENCE: thresholds.max_unclassified_divergence,
        Cause.NEAR_TIE: thresholds.max_near_tie,
        Cause.LENGTH_OR_FINISH: thresholds.max_length_or_finish,
        Cause.REWARD_DISAGREEMENT: thresholds.max_reward_disagreement,
        Cause.LOGPROB_DRIFT: thresholds.max_logprob_drift,
        Cause.PROCESSED_LOGPROBS: thresholds.max_processed_logprobs,
        Cause.PRECISION: thresholds.max_precision,
        Cause.ROUTING: thresholds.max_routing,
    }
    checks = []
    for cause, limit in limits.items():
        count = comparison.cause_counts.get(cause, 0)
        checks.append(Check(f"{CAUSE_LABELS[cause]} fraction", count / total, limit, count / total <= limit,
                            f"{count}/{comparison.total} samples"))
    if comparison.mean_abs_logprob_delta is not None:
        value = comparison.mean_abs_logprob_delta
        checks.append(Check("mean |logprob delta| (nats)", value, thresholds.max_mean_logprob_delta,
                            value <= thresholds.max_mean_logprob_delta, "over common-prefix tokens"))
    for source, score in comparison.scores.items():
        material = abs(score.delta) > thresholds.max_score_delta
        significant = score.p_value < thresholds.alpha
        checks.append(Check(f"score delta {source}", abs(score.delta), thresholds.max_score_delta,
                            not (material and significant), f"p={score.p_value:.3g} ({score.test})"))
    return checks


def compare_artifacts(
    meta_a: ArtifactMeta,
    records_a: list[ValidationRecord],
    meta_b: ArtifactMeta,
    records_b: list[ValidationRecord],
    thresholds: Thresholds | None = None,
    labels: tuple[str, str] | None = None,
) -> Comparison:
    """Diff two artifacts at all four levels and judge them against `thresholds` (see `Comparison.ok`); None = the
    defaults the two sides' recorded dtypes choose (`vlmrl.alignment.precision.precision_of`)."""
    check_comparable(meta_a, records_a, meta_b, records_b)
    label_a, label_b = labels or (meta_a.backend, meta_b.backend)
    if label_a == label_b:
        label_a, label_b = f"A:{label_a}", f"B:{label_b}"
    precision = precision_of(meta_a, meta_b, (label_a, label_b))
    thresholds = thresholds or Thresholds(**precision.defaults)
    greedy = meta_a.sampling.get("temperature", 1.0) == 0 and meta_b.sampling.get("temperature", 1.0) == 0
    by_key_b = {(r.index, r.sample_index): r for r in records_b}
    pairs = sorted(((a, by_key_b[(a.index, a.sample_index)]) for a in records_a),
                   key=lambda pair: (pair[0].index, pair[0].sample_index))
    headers = Headers(weights_difference(meta_a, meta_b), dtype_difference(meta_a, meta_b),
                      processed_sides(meta_a, meta_b, (label_a, label_b)))
    samples = [diff_sample(a, b, greedy, thresholds, headers) for a, b in pairs]
    compared = sum(s.compared_positions for s in samples)
    maxima = [s.max_abs_logprob_delta for s in samples if s.max_abs_logprob_delta is not None]
    comparison = Comparison(
        meta_a=meta_a, meta_b=meta_b, label_a=label_a, label_b=label_b, greedy=greedy,
        precision=precision, thresholds=thresholds,
        setting_differences=setting_differences(meta_a, meta_b),
        samples=samples,
        cause_counts=dict(Counter(s.cause for s in samples if s.cause is not None)),
        exact=sum(1 for s in samples if s.cause is None and s.tokens_equal and s.finish_a == s.finish_b
                  and abs(s.reward_delta) <= thresholds.reward_tolerance),
        max_abs_logprob_delta=float(np.max(maxima)) if maxima else None,  # NaN propagates: a NaN is news
        mean_abs_logprob_delta=(sum(s.mean_abs_logprob_delta * s.compared_positions for s in samples if
                                    s.compared_positions) / compared) if compared else None,
        scores=_scores(records_a, records_b),
        reward_parts=_reward_parts(records_a, records_b),
    )
    comparison.checks = evaluate_checks(comparison, thresholds)
    return comparison

