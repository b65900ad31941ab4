"""The judge reward against real judge servers on the tiny model (CPU, fp32): one SGLang server launched for the
module by a run's reward (reward.judge.server) and ended by closing it, and a vLLM one for the cross-engine check. Both modes score, a batch goes out once and comes back from
the cache (in memory and from the cache file), the free text of a random model is counted as failures while a
constrained verdict parses, and a run's reward combines the judge with the synthetic rule reward, owns its judge (two
runs never share one; a closed run's judge scores no more) and ends the judge server it launched, also when the run's
setup fails."""

from __future__ import annotations

import json
import logging

import pytest

from vlmrl.data.dataset import load_dataset
from vlmrl.rewards.base import FAILED_KEY
from vlmrl.rewards.config import JudgeConfig, JudgeServerConfig, RewardConfig
from vlmrl.rewards.judge import Judge, parse_rating
from vlmrl.rewards.judge_server import launch_judge_server
from vlmrl.rewards.scoring import RewardScorer

from tests.rewards.processes import broken_tool, judge_servers, reward_workers

pytestmark = pytest.mark.sglang

ANSWERS = ["red", "blue", "green", "the shape is yellow"]
"""Four responses to every prompt (n=4)."""


@pytest.fixture(scope="module")
def server(tiny_model_path):
    """The module's judge server, launched as a run launches it: by the run's reward, which owns it."""
    reward = RewardScorer.start(RewardConfig(function="synthetic", timeout_s=0, judge=JudgeConfig(
        enable=True, server=JudgeServerConfig(model_path=tiny_model_path, engine="sglang", max_model_len=1024))),
        ["synthetic/colour"])
    launched = reward.judge.server
    assert launched.pid in judge_servers()
    yield launched
    process = launched.process
    reward.close()
    assert process.poll() is not None and launched.pid not in judge_servers(), \
        "closing the run's reward ends the judge server it launched"


@pytest.fixture(scope="module")
def requests_(processor, tmp_path_factory):
    """Six synthetic colour prompts (each with its image and its question in extra_info)."""
    dataset = load_dataset("synthetic", "train", synthetic_train_size=16, synthetic_val_size=4,
                           root=tmp_path_factory.mktemp("judge-data"))
    return [processor.build_request(dataset[i], i) for i in range(6)]


def responses(requests) -> list[str]:
    return [answer for _ in requests for answer in ANSWERS]


def logprobs_judge(url: str, tiny_model_path: str, **settings) -> Judge:
    judge = Judge(JudgeConfig(enable=True, url=url, mode="logprobs", tokenizer=tiny_model_path, **settings))
    judge.check()
    return judge


def test_logprobs_mode_scores_every_response_from_the_image_and_the_answer(server, tiny_model_path, requests_):
    judge = logprobs_judge(server.url, tiny_model_path)
    verdicts = judge.score(requests_, responses(requests_), len(ANSWERS))
    assert all(v.score is not None and 0 < v.score < 1 for v in verdicts), [v.error for v in verdicts]
    scores = [v.score for v in verdicts]
    first = scores[:len(ANSWERS)]
    assert len(set(first)) == len(ANSWERS), f"the judge reads the answer: {first}"
    assert scores[0] != scores[len(ANSWERS)], "the judge reads the image (same answer, another prompt's image)"
    no_images = Judge(JudgeConfig(enable=True, url=server.url, mode="logprobs", tokenizer=tiny_model_path,
                                  images=False))
    no_images.check()
    assert no_images.score(requests_[:1], ANSWERS, len(ANSWERS))[0].score != scores[0]


def test_a_batch_is_sent_once_and_asked_again_it_comes_from_the_cache(server, tiny_model_path, requests_, tmp_path):
    cache_file = tmp_path / "judge-cache.json"
    judge = logprobs_judge(server.url, tiny_model_path, cache_file=str(cache_file))
    texts = responses(requests_)
    texts[1] = texts[0]  # two samples of one prompt give the same answer: one request
    first = judge.score(requests_, texts, len(ANSWERS))
    assert judge.stats.requests == len(texts) - 1
    again = judge.score(requests_, texts, len(ANSWERS))
    assert judge.stats.requests == len(texts) - 1, "nothing was sent again"
    assert all(v.cached for v in again) and [v.score for v in again] == [v.score for v in first]
    # a new judge (a resumed run) reads the cache file and asks nothing
    assert len(json.loads(cache_file.read_text())["replies"]) == len(texts) - 1
    resumed = logprobs_judge(server.url, tiny_model_path, cache_file=str(cache_file))
    assert [v.score for v in resumed.score(requests_, texts, len(ANSWERS))] == [v.score for v in first]
    assert resumed.stats.requests == 0
    # what the key covers: another sampling setting is another request
    other = logprobs_judge(server.url, tiny_model_path, cache_file=str(cache_file), seed=1)
    other.score(requests_[:1], texts[:len(ANSWERS)], len(ANSWERS))
    assert other.stats.requests == len(ANSWERS) - 1


def test_free_text_that_gives_no_score_fails_counted_and_a_constrained_verdict_parses(server, requests_):
    free = Judge(JudgeConfig(enable=True, url=server.url, mode="generate", max_tokens=12))
    free.check()
    verdicts = free.score(requests_, responses(requests_), len(ANSWERS))
    # the random-init judge writes no "[[N]]": every sample fails, and says why
    assert all(v.score is None and "no match of score_pattern" in v.error for v in verdicts)
    assert free.stats.failures == len(verdicts)
    constrained = Judge(JudgeConfig(enable=True, url=server.url, mode="generate", max_tokens=12, score_range=[0, 9],
                                    extra_body={"regex": r"Rating: \[\[[0-9]\]\]"}))
    constrained.check()
    verdicts = constrained.score(requests_, responses(requests_), len(ANSWERS))
    assert all(v.score is not None for v in verdicts), [v.error for v in verdicts]
    reply = constrained._cache[next(iter(constrained._cache))]["text"]
    assert parse_rating(reply, constrained.config.score_pattern, {}, [0, 9]) in {v.score for v in verdicts}


def test_a_runs_reward_combines_its_own_judge_with_the_synthetic_rule_and_closes_it(server, tiny_model_path,
                                                                                      requests_):
    config = RewardConfig(function="synthetic", timeout_s=0, judge=JudgeConfig(
        enable=True, url=server.url, mode="logprobs", tokenizer=tiny_model_path, weight=0.25))
    reward = RewardScorer.start(config, ["synthetic/colour"])  # starts the run's judge (and checks it answers)
    other = RewardScorer.start(config, ["synthetic/colour"])  # another run in this process, same settings
    assert other.judge is not reward.judge, "two runs never share a judge"
    # to each prompt: its right answer, then three wrong ones
    texts = [text for request in requests_ for text in
             (request.ground_truth, f"{request.ground_truth} maybe", "zebra", f"the shape is {request.ground_truth}")]
    scores = reward.score(requests_, texts, len(ANSWERS))
    assert scores.failures == 0
    for value, part in zip(scores.values, scores.parts):
        assert value == pytest.approx(0.75 * part["rule"] + 0.25 * part["judge"])
        assert part["rule"] == part["accuracy"] and part[FAILED_KEY] == part["judge_failed"] == 0.0
    assert [p["rule"] for p in scores.parts[:len(ANSWERS)]] == [1.0, 0.0, 0.0, 0.0]
    assert 0 < min(p["judge"] for p in scores.parts) < max(p["judge"] for p in scores.parts) < 1
    reward.close()
    with pytest.raises(RuntimeError, match="closed"):
        reward.score(requests_, texts, len(ANSWERS))
    with pytest.raises(RuntimeError, match="is closed"):
        reward.judge.score(requests_, texts, len(ANSWERS))
    assert server.process.poll() is None, "a judge given by URL leaves its server running"
    again = other.score(requests_[:1], texts[:len(ANSWERS)], len(ANSWERS))
    assert [p["judge"] for p in again.parts] == pytest.approx([p["judge"] for p in scores.parts[:len(ANSWERS)]],
                                                              abs=1e-4), "the other run's judge scores on"
    other.close()


# A variant (marker `full`, make test-all; about 60 s beside the module's server): make test keeps a setup that fails
# after the reward started (tests/rewards/test_reward_workers.py) and the run's reward ending the judge server it
# launched (the `server` fixture above); this one shows both in one run.
@pytest.mark.slow
@pytest.mark.full
def test_a_failed_setup_ends_the_judge_server_it_launched_and_the_reward_workers(server, tiny_model_path, tmp_path,
                                                                                  caplog):
    from vlmrl.config import load_config
    from vlmrl.trainer.setup import setup_run

    servers, workers = judge_servers(), reward_workers()
    config = load_config([
        f"actor.model_path={tiny_model_path}", "data.train_files=synthetic", "data.synthetic_train_size=16",
        "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=4", "rollout.name=hf",
        "rollout.n=2", "actor.ppo_mini_batch_size=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.torch_threads=1", f"trainer.output_dir={tmp_path / 'run'}", "reward.function=synthetic",
        "reward.timeout_s=5", "reward.judge.enable=true", f"reward.judge.server.model_path={tiny_model_path}",
        "reward.judge.server.max_model_len=1024", *broken_tool(tmp_path, 4)])
    with caplog.at_level(logging.INFO, logger="vlmrl.rewards"), \
            pytest.raises(ValueError, match="the sandbox service does not answer"):
        setup_run(config)
    assert "judge: server ready" in caplog.text and "reward: 1 worker process(es)" in caplog.text, "both had started"
    assert judge_servers() <= servers and server.pid in judge_servers(), \
        "the run's judge server is gone; the module's is not"
    assert reward_workers() <= workers


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.full  # a variant: the second engine as the judge; make test runs the SGLang judge
def test_a_vllm_judge_server_gives_the_sglang_judges_scores(server, tiny_model_path, requests_):
    """The same requests to both engines (fp32, logprobs after the logit bias) give the same scores."""
    vllm_server = launch_judge_server(JudgeServerConfig(model_path=tiny_model_path, engine="vllm",
                                                        max_model_len=1024))
    try:
        vllm_scores = [v.score for v in logprobs_judge(vllm_server.url, tiny_model_path).score(
            requests_, responses(requests_), len(ANSWERS))]
    finally:
        vllm_server.close()
    sglang_scores = [v.score for v in logprobs_judge(server.url, tiny_model_path).score(
        requests_, responses(requests_), len(ANSWERS))]
    assert vllm_scores == pytest.approx(sglang_scores, abs=1e-4), list(zip(sglang_scores, vllm_scores))


def test_a_rollout_client_of_a_server_without_raw_logprobs_is_refused_in_one_line(server, tiny_model_path):
    """The judge's server runs without SGLANG_RETURN_ORIGINAL_LOGPROB (it reads logprobs after the logit bias): a
    rollout client given its URL finds that at connect and refuses it, naming the setting; the command line reports
    it as one line (exit 2), not a traceback."""
    from vlmrl.rollout.errors import ServerSettingError
    from vlmrl.rollout.registry import get_backend
    from vlmrl.train import reported_error

    with pytest.raises(ServerSettingError, match="after temperature.*SGLANG_RETURN_ORIGINAL_LOGPROB=1") as raised:
        get_backend("sglang-server", tiny_model_path, url=server.url, max_model_len=1024, timeout_s=120)
    message, code = reported_error(raised.value)
    assert code == 2 and "\n" not in message and message.startswith("sglang-server: ")
