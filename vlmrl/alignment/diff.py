"""Where and why two validation artifacts differ: a pure diff at four levels, per sample and in aggregate.

Levels, in the order they explain each other:
  1. inputs   - prompt ids, expanded length, image hashes/sizes/grids. Any difference is reported first: every later
                difference may follow from it.
  2. tokens   - exact match, or the first divergence position with a window of text from both sides.
  3. logprobs - over the common prefix, max and mean |delta|; at the divergence, whether each side's token is in the
                other's top-k with a small margin (a numerical near-tie) or not (a real divergence). This is vLLM's
                divergence-aware rule: compare up to the first differing token, judge it there, then stop.
  4. rewards  - per-sample delta; per data source each side's score with an interval and a paired test.

Each differing sample gets exactly one cause (the earliest level that explains it), see `Cause`. This module diffs
two artifacts (are they comparable, which settings differ, the per-sample diffs, the scores per data source, the
gate); one sample's diff is `vlmrl.alignment.sample_diff`, its token level `vlmrl.alignment.divergence`, the causes
and thresholds `vlmrl.alignment.causes`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vlmrl.alignment.artifact import ArtifactMeta, ValidationRecord
from vlmrl.alignment.causes import CAUSE_LABELS, Cause, Thresholds
from vlmrl.alignment.precision import Precision, dtype_difference, precision_of
from vlmrl.alignment.sample_diff import (
    Headers,
    SampleDiff,
    diff_sample,
    numeric_parts,
    processed_sides,
    weights_difference,
)
from vlmrl.alignment.stats import PairedScore, paired_score

OVERALL = "(all)"


class NotComparableError(ValueError):
    """The two artifacts cannot be compared sample by sample (other dataset, other rows). compare exits with 2."""


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
            for key, value in numeric_parts(record.reward_extra).items():
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
