"""Rewards: geo3k and synthetic scores, dispatch by data_source, user functions by file path, contained failures."""

from __future__ import annotations

import doctest
import logging
import math
import textwrap

import pytest

import vlmrl.rewards.base
import vlmrl.rewards.geo3k
import vlmrl.rewards.registry
import vlmrl.rewards.synthetic
from vlmrl.rewards.base import FAILED_KEY, RewardInput
from vlmrl.rewards.registry import get_reward_fn
from vlmrl.rewards.scoring import compute_rewards

GEO = "hiyouga/geometry3k"


@pytest.mark.parametrize("module", [vlmrl.rewards.base, vlmrl.rewards.geo3k, vlmrl.rewards.registry,
                                    vlmrl.rewards.synthetic], ids=lambda m: m.__name__)
def test_doctests(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, f"{result.failed} doctest(s) failed in {module.__name__}"


@pytest.mark.parametrize(("response", "truth", "expected"), [
    (r"<think>angle sum is 180</think> So x = \boxed{45}.", "45", (1.0, 1.0, 1.0)),
    (r"<think>a</think> \boxed{\frac{3}{4}}", "0.75", (1.0, 1.0, 1.0)),
    (r"<think>a</think> \boxed{12}", "13", (0.1, 0.0, 1.0)),
    (r"x is \boxed{13}", "13", (0.9, 1.0, 0.0)),
    ("<think>no box</think> 13", "13", (0.0, 0.0, 0.0)),
    (r"<think>a</think> \boxed{7} wait, \boxed{8}", "8", (1.0, 1.0, 1.0)),  # the last box is the answer
    (r"<think>a</think> \boxed{None}", "None", (1.0, 1.0, 1.0)),
    ("<think>a</think> None", "None", (0.0, 0.0, 0.0)),  # no box is never right, whatever the ground truth
])
def test_geo3k_score_is_point_nine_accuracy_plus_point_one_format(response, truth, expected):
    scores, extras, failures = compute_rewards(get_reward_fn("geo3k"), [RewardInput(GEO, response, truth)])
    assert failures == 0
    assert (scores[0], extras[0]["accuracy"], extras[0]["format"]) == pytest.approx(expected)


def test_synthetic_reward_matches_the_word_only():
    fn = get_reward_fn("synthetic")
    items = [RewardInput("synthetic/colour", text, "red")
             for text in ["red", "Red.", " RED \n", "red<|im_end|>", "blue", "red red", "the shape is red", ""]]
    scores, extras, _ = compute_rewards(fn, items)
    assert scores == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert [e["format"] for e in extras] == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_auto_dispatches_by_data_source_and_refuses_unknown_sources_at_load():
    fn = get_reward_fn("", data_sources=["synthetic/count", GEO])
    scores, _, failures = compute_rewards(fn, [RewardInput("synthetic/count", "3", "3"),
                                               RewardInput(GEO, r"<think>t</think> \boxed{3}", "3"),
                                               RewardInput(GEO, "3", "3")])
    assert (scores, failures) == ([1.0, 1.0, 0.0], 0)
    with pytest.raises(ValueError, match=r"data_source 'openai/gsm8k'.*reward.function"):
        get_reward_fn("auto", data_sources=["synthetic/colour", "openai/gsm8k"])
    with pytest.raises(ValueError, match="reward.function='nope'"):
        get_reward_fn("nope")


def _write(path, source: str) -> str:
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_a_verl_compute_score_file_works_unchanged(tmp_path):
    # verl's custom_reward_function contract: keyword call, float or dict with "score" (+ any extra info).
    path = _write(tmp_path / "my_reward.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": float(solution_str.strip() == ground_truth), "acc": solution_str == ground_truth,
                    "pred": solution_str, "split": extra_info["split"]}

        def length_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            return -len(solution_str) / 10
    """)
    items = [RewardInput("mine", "ok", "ok", {"split": "val"}), RewardInput("mine", "no", "ok", {"split": "val"})]
    scores, extras, failures = compute_rewards(get_reward_fn(f"{path}:compute_score"), items)
    assert (scores, failures) == ([1.0, 0.0], 0)
    assert extras == [{"acc": 1.0, FAILED_KEY: 0.0}, {"acc": 0.0, FAILED_KEY: 0.0}]  # strings are not parts
    assert compute_rewards(get_reward_fn(f"{path}:length_score"), items)[0] == [-0.2, -0.2]
    assert get_reward_fn("vlmrl.rewards.synthetic:compute_score") is vlmrl.rewards.synthetic.compute_score


def test_user_function_errors_name_what_to_fix(tmp_path):
    path = _write(tmp_path / "bad.py", """
        def two_args(response, truth):
            return 1.0

        def fine(data_source, solution_str, ground_truth, extra_info):
            return 1.0
    """)
    with pytest.raises(ValueError, match=r"two_args\(response, truth\) cannot be called"):
        get_reward_fn(f"{path}:two_args")
    with pytest.raises(ValueError, match=r"no function 'missing' \(functions there: \['fine', 'two_args'\]\)"):
        get_reward_fn(f"{path}:missing")
    with pytest.raises(FileNotFoundError, match="nowhere.py"):
        get_reward_fn(f"{tmp_path}/nowhere.py:fn")


def test_failing_nan_and_non_numeric_rewards_score_zero_flagged_and_the_batch_goes_on(tmp_path, caplog):
    path = _write(tmp_path / "flaky.py", """
        import math

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "raise":
                raise RuntimeError("grader crashed")
            value = {"nan": math.nan, "inf": math.inf, "text": "high", "none": None}.get(solution_str, 0.5)
            return {"score": value, "accuracy": 1.0}
    """)
    responses = ["ok", "raise", "nan", "ok", "inf", "text", "none"]
    items = [RewardInput("mine", r, "x") for r in responses]
    with caplog.at_level(logging.WARNING, logger="vlmrl.rewards.scoring"):
        scores, extras, failures = compute_rewards(get_reward_fn(f"{path}:compute_score"), items)
    assert failures == 5
    assert scores == [0.5, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0]
    assert all(math.isfinite(s) for s in scores)
    assert [e[FAILED_KEY] for e in extras] == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert all(set(e) == {"accuracy", FAILED_KEY} for e in extras), "every sample must carry the same keys"
    assert [e["accuracy"] for e in extras] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one log line per batch, not one per failing sample"
    assert "5 of 7" in warnings[0].getMessage() and "'raise'" in warnings[0].getMessage()
    assert "grader crashed" in caplog.text


def test_reward_input_from_a_request_carries_its_row_metadata():
    from vlmrl.types import RolloutRequest

    request = RolloutRequest(uid="u", prompt_ids=[1], data_source="synthetic/colour", ground_truth="red",
                             extra_info={"split": "val"})
    item = RewardInput.from_request(request, "Red")
    assert item == RewardInput("synthetic/colour", "Red", "red", {"split": "val"})
    assert compute_rewards(get_reward_fn("auto"), [item])[0] == [1.0]


@pytest.mark.parametrize("name, response", [("geo3k", r"<think>x</think> \boxed{None}"), ("synthetic", "None")])
def test_a_sample_without_ground_truth_is_a_counted_failure_not_a_right_answer(name, response):
    """str(None) == "None": without the check, answering None to a row missing its ground truth scored 1.0."""
    scores, extras, failures = compute_rewards(get_reward_fn(name), [RewardInput("src", response, None)])
    assert (scores, failures, extras[0][FAILED_KEY]) == ([0.0], 1, 1.0)


class _Stop(BaseException):
    """A BaseException that is neither Exception nor KeyboardInterrupt (what some libraries raise to unwind)."""


@pytest.mark.parametrize("raised", [SystemExit(3), _Stop("unwind")], ids=["SystemExit", "other BaseException"])
def test_in_process_scoring_counts_a_base_exception_as_a_failure_not_the_end_of_the_run(raised):
    def reward(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "exit":
            raise raised
        return 1.0

    items = [RewardInput("mine", r, "x") for r in ("ok", "exit", "ok")]
    scores, extras, failures = compute_rewards(reward, items, timeout_s=0)  # scored here, in this process
    assert (scores, failures) == ([1.0, 0.0, 1.0], 1)
    assert [e[FAILED_KEY] for e in extras] == [0.0, 1.0, 0.0]


def test_ctrl_c_during_in_process_scoring_still_stops():
    def reward(**kwargs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compute_rewards(reward, [RewardInput("mine", "a", "x")], timeout_s=0)
