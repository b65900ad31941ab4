"""Scoring a run's responses: n per request against each request's row, a typed Scores record, failures counted;
a run's reward (`RewardScorer`) scores only while it is open."""

from __future__ import annotations

import pytest

from vlmrl.config import RewardConfig
from vlmrl.rewards.config import JudgeConfig
from vlmrl.rewards.base import FAILED_KEY
from vlmrl.rewards.scoring import RewardScorer, Scores, response_texts, score_texts
from vlmrl.types import RolloutRequest, RolloutResult

IN_PROCESS = RewardConfig(timeout_s=None)


def _requests() -> list[RolloutRequest]:
    return [RolloutRequest(uid="a", prompt_ids=[1], data_source="synthetic/colour", ground_truth="red",
                           extra_info={"split": "train"}),
            RolloutRequest(uid="b", prompt_ids=[1], data_source="synthetic/shape", ground_truth="circle")]


def test_texts_are_scored_n_per_request_against_their_own_row():
    requests = _requests()
    seen = []

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, ground_truth, extra_info))
        return {"score": float(solution_str == ground_truth), "accuracy": float(solution_str == ground_truth)}

    scores = score_texts(reward, requests, ["red", "blue", "square", "circle"], 2, IN_PROCESS)
    assert scores == Scores([1.0, 0.0, 0.0, 1.0], [{"accuracy": v, FAILED_KEY: 0.0} for v in (1.0, 0.0, 0.0, 1.0)], 0)
    assert seen == [("synthetic/colour", "red", {"split": "train"})] * 2 + [("synthetic/shape", "circle", {})] * 2
    seen[0][2]["split"] = "changed by a reward function"
    assert requests[0].extra_info == {"split": "train"}, "each response gets its own copy of the row's extra_info"


def test_a_failing_sample_scores_zero_counted_and_a_miscounted_batch_is_refused():
    def reward(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise RuntimeError("broken grader")
        return 1.0

    scores = score_texts(reward, _requests(), ["red", "boom"], 1, IN_PROCESS)
    assert (scores.values, scores.failures, scores.parts[1][FAILED_KEY]) == ([1.0, 0.0], 1, 1.0)
    with pytest.raises(ValueError, match="3 responses for 2 requests x n=2"):
        score_texts(reward, _requests(), ["a", "b", "c"], 2, IN_PROCESS)


def test_the_run_reward_function_scores_decoded_responses(tiny_model_path):
    from vlmrl.processors.loading import load_processor

    processor = load_processor(tiny_model_path)
    reward = RewardScorer.start(IN_PROCESS, ["synthetic/colour"])
    tokenizer = processor.tokenizer
    ids = tokenizer.encode("red", add_special_tokens=False) + [processor.eos_token_ids[0]]
    texts = response_texts(tokenizer, [RolloutResult("a", 0, ids, [0.0] * len(ids), "stop")])
    assert texts == ["red"], "special tokens (the end of turn) are skipped, as verl decodes"
    assert reward.score(_requests()[:1], texts, 1).values == [1.0]
    assert reward.workers is None and reward.judge is None, "no limit, no judge: nothing started"
    reward.close()
    with pytest.raises(RuntimeError, match="the run's reward is closed"):
        reward.score(_requests()[:1], texts, 1)


def test_a_judged_reward_without_its_judge_is_refused():
    config = RewardConfig(timeout_s=None, judge=JudgeConfig(enable=True, url="http://127.0.0.1:1"))
    with pytest.raises(ValueError, match="reward.judge.enable needs the judge"):
        score_texts(lambda **kw: 1.0, _requests()[:1], ["red"], 1, config)
