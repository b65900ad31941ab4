"""The pure diff on synthetic artifacts: every injected fault lands in its own cause bucket, and the gate follows."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap

import pytest

from tests.alignment.test_routing_cause import routing_of
from tests.alignment.toy_artifacts import VOCAB, make_side, reward_first_letter
from vlmrl.alignment.causes import Cause, Thresholds
from vlmrl.alignment.diff import OVERALL, NotComparableError, compare_artifacts
from vlmrl.alignment.divergence import text_window
from vlmrl.alignment.inputs import diff_inputs
from vlmrl.alignment.sample_diff import Headers, classify, diff_sample


def _compare(thresholds=None, a=None, **b_kwargs):
    a = a or make_side()
    b = make_side(backend="sglang", **b_kwargs)
    return compare_artifacts(*a, *b, thresholds=thresholds)


def _failed(comparison):
    return sorted(check.name for check in comparison.checks if not check.ok)


def test_identical_outputs_are_exact_and_aligned():
    comparison = _compare()
    assert comparison.exact == comparison.total == 30 and comparison.cause_counts == {}
    assert comparison.max_abs_logprob_delta == 0.0 and comparison.ok
    assert comparison.scores[OVERALL].delta == 0.0 and comparison.scores[OVERALL].p_value == 1.0
    assert ("backend", "vllm", "sglang") in comparison.setting_differences


def test_other_max_pixels_is_an_input_mismatch_first():
    comparison = _compare(max_pixels=6000)
    assert comparison.cause_counts == {Cause.INPUT_MISMATCH: 30}, "outputs differ too, but inputs explain them"
    sample = comparison.samples[0]
    assert any("resized to" in d for d in sample.input_diffs) and any("grid_thw" in d for d in sample.input_diffs)
    assert ("config.data.max_pixels", 12544, 6000) in comparison.setting_differences
    assert not comparison.ok and "input mismatch fraction" in _failed(comparison)


def test_perturbed_weights_are_real_divergences_with_logprob_drift():
    comparison = _compare(logit_noise=2.0)
    assert comparison.cause_counts == {Cause.REAL_DIVERGENCE: 30}
    assert comparison.mean_abs_logprob_delta > 0.05
    assert _failed(comparison) == ["mean |logprob delta| (nats)", "real divergence fraction"]
    split = comparison.samples[0].divergence
    assert split.position == 0 and split.token_a != split.token_b


def test_swapped_top_two_is_a_near_tie_and_tolerated_by_default():
    comparison = _compare(flip_rows=frozenset({1, 4, 7}))
    assert comparison.cause_counts == {Cause.NEAR_TIE: 3} and comparison.exact == 27
    tie = next(s for s in comparison.samples if s.cause == Cause.NEAR_TIE)
    assert tie.divergence.position == 2 and tie.divergence.b_in_top_a and tie.divergence.a_in_top_b
    assert tie.divergence.margin_a + tie.divergence.margin_b < 1e-3
    assert tie.max_abs_logprob_delta < 1e-9, "the common prefix before the tie is identical"
    assert comparison.ok
    strict = _compare(thresholds=Thresholds(max_near_tie=0.0), flip_rows=frozenset({1, 4, 7}))
    assert _failed(strict) == ["numerical near-tie fraction"]


def test_near_tie_needs_a_small_margin():
    # Same flips, but a near-tie margin tighter than the 2e-4 the toy model leaves: they become real divergences.
    comparison = _compare(thresholds=Thresholds(near_tie_margin=1e-5), flip_rows=frozenset({1, 4}))
    assert comparison.cause_counts == {Cause.REAL_DIVERGENCE: 2}


@pytest.mark.parametrize("top_k", [None, 1])
def test_divergence_without_top_k_is_not_guessed(top_k):
    """No top-k, or top-1 (the side's own token only: the other's could never be in it), cannot tell a near-tie."""
    a = make_side(top_k=top_k)
    comparison = compare_artifacts(*a, *make_side(backend="sglang", top_k=top_k, flip_rows=frozenset({2})))
    assert comparison.cause_counts == {Cause.UNCLASSIFIED_DIVERGENCE: 1} and not comparison.ok


def test_different_reward_function_on_equal_text_is_a_reward_disagreement():
    comparison = _compare(reward=reward_first_letter)
    assert set(comparison.cause_counts) == {Cause.REWARD_DISAGREEMENT}
    sample = next(s for s in comparison.samples if s.cause == Cause.REWARD_DISAGREEMENT)
    assert sample.tokens_equal and sample.reward_extra_deltas["accuracy"] == sample.reward_delta != 0
    assert "reward disagreement on equal text fraction" in _failed(comparison)


def test_shorter_budget_is_length_or_finish_only():
    comparison = _compare(max_new_tokens=5)
    assert set(comparison.cause_counts) == {Cause.LENGTH_OR_FINISH}
    sample = comparison.samples[0]
    assert sample.finish_b == "length" and sample.length_b == 5 and sample.divergence is None


def test_sampled_outputs_are_compared_statistically_only():
    a = make_side(temperature=1.0)
    comparison = compare_artifacts(*a, *make_side(backend="sglang", temperature=1.0, logit_noise=2.0))
    assert not comparison.greedy and comparison.cause_counts == {}
    assert "sampled" in comparison.samples[0].explanation


def test_a_systematic_score_gap_is_significant_and_fails_the_gate():
    # B's reward is 1 on every row A scored 0 (the text is the same: also a reward disagreement).
    a = make_side()
    meta_b, records_b = make_side(backend="sglang")
    for record in records_b:
        record.reward = 1.0
    comparison = compare_artifacts(*a, meta_b, records_b, thresholds=Thresholds(max_reward_disagreement=1.0))
    overall = comparison.scores[OVERALL]
    assert overall.delta > 0.5 and overall.p_value < 1e-4 and set(comparison.scores) == {OVERALL, "colours", "shapes"}
    assert _failed(comparison) == ["score delta (all)", "score delta colours", "score delta shapes"]


def test_other_dataset_or_other_rows_are_not_comparable():
    with pytest.raises(NotComparableError, match="different datasets"):
        _compare(dataset="geo3k:test")
    a = make_side()
    meta_b, records_b = make_side(backend="sglang")
    with pytest.raises(NotComparableError, match="row 29 sample 0 only in A"):
        compare_artifacts(*a, meta_b, records_b[:-1])
    records_b[3] = dataclasses.replace(records_b[3], ground_truth="zz")
    with pytest.raises(NotComparableError, match="row 3 .* not the same"):
        compare_artifacts(*a, meta_b, records_b)


def test_input_diff_and_text_window_details():
    _, (a, *_) = make_side()
    b = dataclasses.replace(a, prompt_ids=a.prompt_ids[:2] + [7] + a.prompt_ids[3:], image_hashes=["other"])
    diffs = diff_inputs(a, b)
    assert diffs[0].startswith("prompt ids differ from position 2") and "image 0 bytes differ" in diffs[1]
    window = text_window("the answer is 42.", "the answer is 47!")
    assert (window.position, window.before, window.after_a, window.after_b) == (15, "the answer is 4", "2.", "7!")
    assert text_window("same", "same") is None


def test_same_tokens_with_other_logprobs_is_drift_not_exact():
    a = make_side()
    meta_b, records_b = make_side(backend="sglang")
    records_b[5].response_logprobs = [lp - 0.5 for lp in records_b[5].response_logprobs]
    records_b[6].response_logprobs = [lp - 0.01 for lp in records_b[6].response_logprobs]  # within tolerance
    comparison = compare_artifacts(*a, meta_b, records_b)
    assert comparison.cause_counts == {Cause.LOGPROB_DRIFT: 1} and comparison.exact == 29
    assert comparison.samples[5].cause == Cause.LOGPROB_DRIFT and "up to 0.5 nats" in comparison.samples[5].explanation
    assert _failed(comparison) == [], "drift on one sample keeps the mean delta under its limit"
    records_b[7].response_logprobs = [float("nan")] * len(records_b[7].response_logprobs)
    comparison = compare_artifacts(*a, meta_b, records_b)
    assert comparison.samples[7].cause == Cause.LOGPROB_DRIFT, "NaN logprobs are never 'within tolerance'"
    assert "mean |logprob delta| (nats)" in _failed(comparison)


def test_a_side_whose_header_says_processed_logprobs_is_named_for_them():
    """Without the trainer's values of the sampled distribution (an engine against an engine, or a trainer side
    that recorded none), a side whose header says its engine returned processed logprobs is named for them where its
    logprobs differ beyond the tolerance; the same values with a raw header are drift."""
    a = make_side(temperature=0.7)
    meta_b, records_b = make_side(backend="sglang", temperature=0.7)
    records_b[3].response_logprobs = [lp - 0.3 for lp in records_b[3].response_logprobs]
    assert compare_artifacts(*a, meta_b, records_b).cause_counts == {Cause.LOGPROB_DRIFT: 1}
    meta_b.logprobs_mode = "processed_logprobs"
    comparison = compare_artifacts(*a, meta_b, records_b)
    assert comparison.cause_counts == {Cause.PROCESSED_LOGPROBS: 1} and not comparison.ok
    assert "sglang's engine ran with logprobs_mode=processed_logprobs" in comparison.samples[3].explanation


def test_the_headers_dtypes_choose_the_thresholds():
    """float32 on both headers: the float32 defaults; a bfloat16 side, or one that recorded no dtype (only a
    configured `auto`): the bfloat16 band, with the reason. Thresholds given by the caller are kept as given."""
    (meta_a, records_a), (meta_b, records_b) = make_side(), make_side(backend="sglang")
    meta_a.dtype = meta_b.dtype = "float32"
    meta_a.config["rollout"]["dtype"] = meta_b.config["rollout"]["dtype"] = "auto"
    comparison = compare_artifacts(meta_a, records_a, meta_b, records_b)
    assert comparison.precision.float32 and comparison.thresholds.drift_tolerance == 0.001
    meta_b.dtype = "bfloat16"
    comparison = compare_artifacts(meta_a, records_a, meta_b, records_b)
    assert comparison.thresholds == Thresholds() and "a side computed below float32" in comparison.precision.reason
    meta_b.dtype = ""
    comparison = compare_artifacts(meta_a, records_a, meta_b, records_b, Thresholds(drift_tolerance=0.2))
    assert comparison.thresholds.drift_tolerance == 0.2 and not comparison.precision.float32
    assert comparison.precision.reason.startswith("sglang recorded no dtype (vllm float32, sglang unknown")


def test_doctests():
    import doctest

    import vlmrl.alignment.precision as precision

    assert doctest.testmod(precision).failed == 0


# ---------------------------------------------------------------------------------------------- every cause's words


def _record():
    _, (record, *_) = make_side(rows=1)
    return record


def _shifted(record, by: float):
    return [lp - by for lp in record.response_logprobs]


def _split(*, margin: float, b_in_a: bool = True, a_in_b: bool = True, top: bool = True, routed: bool = False):
    """A toy record and a B that chose another token at response position 1, where each side's top-k holds the
    other's token (`b_in_a`, `a_in_b`) half of `margin` below its own (or not at all); `top` False: B recorded no
    top-k; `routed`: B routed the response's first token through other experts in MoE layer 1."""
    a = _record()
    ta, lp = a.response_ids[1], a.response_logprobs[1]
    tb, elsewhere = (ta + 1) % VOCAB, (ta + 2) % VOCAB
    top_a, top_b = list(a.top_logprobs), list(a.top_logprobs)
    top_a[1] = [[ta, lp], [tb if b_in_a else elsewhere, lp - margin / 2]]
    top_b[1] = [[tb, lp], [ta if a_in_b else elsewhere, lp - margin / 2]]
    a = dataclasses.replace(a, top_logprobs=top_a)
    b = dataclasses.replace(a, response_ids=[a.response_ids[0], tb, *a.response_ids[2:]],
                            top_logprobs=top_b if top else None)
    if routed:
        a.routing, b.routing = routing_of(a), routing_of(b, [(a.expanded_prompt_length - 1, 1)])
    return a, b


def _drifted(by: float = 0.5, *, tempered: float | None = None, routed: bool = False, **b_changes):
    """A toy record and a B with the same tokens whose logprobs are `by` nats lower; A's `tempered_logprobs` (the
    trainer's of the distribution B sampled) `tempered` nats from B's."""
    a = _record()
    b = dataclasses.replace(a, **{"response_logprobs": _shifted(a, by), **b_changes})
    if tempered is not None:
        a = dataclasses.replace(a, tempered_logprobs=_shifted(a, by + tempered))
    if routed:
        a.routing, b.routing = routing_of(a), routing_of(b, [(a.expanded_prompt_length - 1, 1)])
    return a, b


PROCESSED = "B's engine ran with logprobs_mode=processed_logprobs"
# (id, (A, B), greedy, headers, the cause, a part of its explanation): every explanation `classify` gives
CAUSES = [
    ("inputs", lambda: (_record(), dataclasses.replace(_record(), image_hashes=["other"])), True, Headers(),
     Cause.INPUT_MISMATCH, "image 0 bytes differ"),
    ("weights", lambda: _drifted(), True, Headers(weights="the sides loaded other weights"),
     Cause.WEIGHTS_DIFFER, "the sides loaded other weights; same "),
    ("sampled", lambda: _split(margin=0.1), False, Headers(), None, "sampled decoding: different tokens"),
    ("no-top-k", lambda: _split(margin=0.1, top=False), True, Headers(), Cause.UNCLASSIFIED_DIVERGENCE,
     "no top-k logprobs to judge it"),
    ("near-tie", lambda: _split(margin=0.1), True, Headers(), Cause.NEAR_TIE,
     "each in the other's top-k, margins add to 0.1000 nats"),
    ("routed-split", lambda: _split(margin=2.0, routed=True), True, Headers(), Cause.ROUTING,
     "before it, 1 of "),
    ("wide-margin", lambda: _split(margin=2.0), True, Headers(), Cause.REAL_DIVERGENCE,
     "in each other's top-k but margins add to 2.000 nats"),
    ("not-in-top-k", lambda: _split(margin=0.1, a_in_b=False), True, Headers(), Cause.REAL_DIVERGENCE,
     "A's token not in B's top-k"),
    ("length", lambda: _drifted(0.0, response_ids=_record().response_ids[:3],
                                response_logprobs=_record().response_logprobs[:3], finish_reason="length"),
     True, Headers(), Cause.LENGTH_OR_FINISH, "same tokens up to 3"),
    ("reward", lambda: _drifted(0.0, reward=1.0 - _record().reward), True, Headers(),
     Cause.REWARD_DISAGREEMENT, "identical response scored"),
    ("tempered", lambda: _drifted(tempered=0.0), True, Headers(), Cause.PROCESSED_LOGPROBS,
     "that side returned processed logprobs"),
    ("processed-header", lambda: _drifted(), True, Headers(processed=PROCESSED), Cause.PROCESSED_LOGPROBS,
     f"{PROCESSED}, so they are of the distribution it sampled"),
    ("routed-drift", lambda: _drifted(routed=True), True, Headers(), Cause.ROUTING,
     "before the largest gap, 1 of "),
    ("drift", lambda: _drifted(), True, Headers(), Cause.LOGPROB_DRIFT, "logprobs differ by up to 0.5 nats"),
    ("drift-though-processed", lambda: _drifted(tempered=0.3), True, Headers(processed=PROCESSED),
     Cause.LOGPROB_DRIFT, f"; {PROCESSED}, yet they are 0.3 nats from the distribution it sampled too"),
    ("precision", lambda: _drifted(0.01), True, Headers(dtypes="bfloat16 on B"), Cause.PRECISION,
     "within the 0.1-nat band of bfloat16 on B"),
    ("exact", lambda: _drifted(0.0), True, Headers(), None, ""),
]


def _judged(case):
    _, pair, greedy, headers, *_ = case
    sample = diff_sample(*pair(), greedy, Thresholds(), headers)
    return sample.cause, sample.explanation


@pytest.mark.parametrize("case", CAUSES, ids=[case[0] for case in CAUSES])
def test_each_explanation_the_cause_logic_gives(case):
    """One pair of records per explanation: its cause and its words. A split whose tokens sit in each other's top-k
    with margins wider than a near-tie is a real divergence that says so (it was left with no words)."""
    cause, explanation = _judged(case)
    assert cause == case[-2] and case[-1] in explanation, (cause, explanation)
    assert cause is None or explanation, "a cause always comes with its explanation"


def test_the_cases_reach_every_return_of_the_cause_logic():
    """Every `return` of the cause function runs for some case above: a return no input reaches (a line left after
    another return) fails here, naming its line."""
    code = classify.__code__
    source = textwrap.dedent(inspect.getsource(classify))
    returns = {code.co_firstlineno - 1 + node.lineno for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Return)}
    ran: set[int] = set()

    def trace(frame, event, arg):
        if frame.f_code is code:
            if event == "line":
                ran.add(frame.f_lineno)
            return trace
        return None

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        for case in CAUSES:
            _judged(case)
    finally:
        sys.settrace(before)
    lines = inspect.getsourcelines(classify)[0]
    missed = {n: lines[n - code.co_firstlineno].strip() for n in sorted(returns - ran)}
    assert returns and not missed, f"returns of classify no case reaches: {missed}"
