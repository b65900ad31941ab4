"""The judge reward without an engine: its scoring rules (doctests), the config checks at load, templates, how it
combines with the rule reward, and the real failures a user meets: a closed port (refused at start, closing what the
run's reward had already started, and counted as failures after retries when the server goes away) and a server that
never answers (timed out, retried, counted). tests/rewards/test_judge_server.py runs it against real SGLang and vLLM
servers."""

from __future__ import annotations

import doctest
import json
import logging
import shutil
import socket
import time
from pathlib import Path

import pytest
from PIL import Image

import vlmrl.rewards.judge
import vlmrl.rewards.judge_server
from vlmrl.config import ConfigError, load_config
from vlmrl.rewards.base import FAILED_KEY
from vlmrl.rewards.config import JudgeConfig, RewardConfig
from vlmrl.rewards.judge import Judge, JudgeError, combine, start_judge
from vlmrl.rewards.judge_prompt import render_text
from vlmrl.rewards.registry import get_reward_fn
from vlmrl.rewards.scoring import RewardScorer, score_texts
from vlmrl.types import RolloutRequest

from tests.rewards.processes import reward_workers


@pytest.mark.parametrize("module", [vlmrl.rewards.judge, vlmrl.rewards.judge_server], ids=lambda m: m.__name__)
def test_doctests(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, f"{result.failed} doctest(s) failed in {module.__name__}"


def request(colour: str = "red", answer: str = "red", **extra) -> RolloutRequest:
    image = Image.new("RGB", (56, 56), colour)
    return RolloutRequest(uid=colour, prompt_ids=[1], images=[image], image_hashes=[f"hash-{colour}"],
                          data_source="synthetic/colour", ground_truth=answer,
                          extra_info={"question": "What colour is the shape?", **extra})


def closed_port() -> int:
    """A port nothing listens on (bound, then released): connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------- config


def judge_args(*extra: str) -> list[str]:
    return ["actor.model_path=tiny", "data.train_files=synthetic", "data.val_files=synthetic",
            "reward.judge.enable=true", "reward.judge.url=http://127.0.0.1:8000", *extra]


def problems_of(*extra: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(judge_args(*extra), check_model=False)
    return str(err.value)


def test_a_valid_judge_config_loads():
    config = load_config(judge_args("reward.judge.mode=logprobs", "reward.judge.tokenizer=tiny",
                                    "reward.judge.weight=0.3"), check_model=False)
    assert config.reward.judge.weight == 0.3 and config.reward.judge.choices == {"Yes": 1.0, "No": 0.0}
    assert load_config(judge_args()[:3], check_model=False).reward.judge.enable is False


@pytest.mark.parametrize(("extra", "message"), [
    (("reward.judge.server.model_path=tiny",), "exactly one of reward.judge.url"),
    (("reward.judge.url=",), "exactly one of reward.judge.url"),
    (("reward.judge.url=localhost:8000",), "must start with http://"),
    (("reward.judge.mode=score",), "reward.judge.mode='score'"),
    (("reward.judge.weight=1.5",), "reward.judge.weight=1.5 must be in [0, 1]"),
    (("reward.judge.score_pattern=(a)(b)",), "has 2 groups"),
    (("reward.judge.score_pattern=([",), "is not a regular expression"),
    (("reward.judge.template=Rate {answer}",), "it may use only"),
    (("reward.judge.template=Rate it {question}",), "never shows the judge the {response}"),
    (("reward.judge.template=Rate {response",), "not a valid format string"),
    (("reward.judge.mode=logprobs",), "needs the judge's tokenizer"),
    (("reward.judge.timeout_s=0",), "every judge request has a deadline"),
    (("reward.judge.max_concurrency=0",), "reward.judge.max_concurrency=0 must be >= 1"),
    (("reward.judge.score_range=[5,1]",), "low < high"),
])
def test_invalid_judge_settings_are_refused_at_load_saying_what_to_change(extra, message):
    assert message in problems_of(*extra)


def test_the_demo_overlay_loads_on_the_cpu_demo():
    configs = Path(__file__).resolve().parents[2] / "examples" / "configs"
    config = load_config([f"config={configs / 'tiny_synthetic.yaml'}",
                          f"config={configs / 'tiny_synthetic_judge.yaml'}"])
    judge = config.reward.judge
    assert judge.enable and judge.mode == "logprobs" and judge.server.model_path == "tiny" and judge.weight == 0.5
    assert config.reward.function == "synthetic"


def test_the_old_judge_server_keys_still_load_with_a_warning_naming_the_new_key():
    """reward.judge.server.host / port / log_file moved to reward.judge.server.http (the rollout's server options),
    reward.judge.server.args to the engine's engine_kwargs: for one release the old keys still load."""
    with pytest.warns(FutureWarning) as caught:
        config = load_config(judge_args("reward.judge.server.port=8123", "reward.judge.server.engine=vllm",
                                        "reward.judge.server.args={max_num_seqs: 4}"), check_model=False)
    server = config.reward.judge.server
    assert server.http.port == 8123 and server.vllm.engine_kwargs == {"max_num_seqs": 4}
    messages = [str(w.message) for w in caught]
    assert any("'reward.judge.server.port'" in m and "is now 'reward.judge.server.http.port'" in m for m in messages)
    assert any("'reward.judge.server.args' is now per engine: reward.judge.server.vllm.engine_kwargs" in m
               for m in messages), messages


@pytest.mark.parametrize(("engine", "flag"), [("sglang", "--json-model-override-args"), ("vllm", "--hf-overrides")])
def test_a_launched_judge_starts_with_the_model_familys_settings(engine, flag, tiny_qwen3_vl_path, tmp_path,
                                                                 monkeypatch):
    """A Qwen3-VL judge whose config.json lacks mrope_interleaved is started with it, as the rollout engines are
    (without it vLLM and SGLang compute another model than the checkpoint's), and with the engines' CPU settings."""
    from vlmrl.rewards.config import JudgeServerConfig
    from vlmrl.rewards.judge_server import server_command

    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "SGLANG_USE_CPU_ENGINE"):
        monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "qwen3-vl-flagless"
    shutil.copytree(tiny_qwen3_vl_path, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]["rope_parameters"]["mrope_interleaved"]
    (folder / "config.json").write_text(json.dumps(config))
    _, server_flags, env = server_command(JudgeServerConfig(model_path=str(folder), engine=engine), str(folder),
                                          seed=0, top_logprobs=20, on_cuda=False)
    overrides = json.loads(server_flags[server_flags.index(flag) + 1])
    assert overrides["text_config"]["rope_parameters"]["mrope_interleaved"] is True
    if engine == "sglang":
        assert server_flags[server_flags.index("--device") + 1] == "cpu" and env["SGLANG_USE_CPU_ENGINE"] == "1"
        assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in env, "the judge reads logprobs after the logit bias"
        assert int(server_flags[server_flags.index("--nccl-port") + 1]) > 0, "drawn by vlmrl, not by SGLang"
    else:
        assert "--enforce-eager" in server_flags and env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                             "VLLM_CPU_KVCACHE_SPACE": "1"}
        assert server_flags[server_flags.index("--logprobs-mode") + 1] == "processed_logprobs"


def test_a_judge_only_reward_is_reward_function_none_with_weight_one():
    config = load_config(judge_args("reward.function=none"), check_model=False)
    assert get_reward_fn(config.reward.function)(data_source="x", solution_str="a", ground_truth=None) == 0.0
    assert "reward.function=none scores every sample 0" in problems_of("reward.function=none",
                                                                       "reward.judge.weight=0.5")


# ---------------------------------------------------------------------------------------------------- templates


def test_the_template_shows_the_row_and_the_response():
    text = render_text("Q: {question} | A: {response} | truth: {ground_truth} | shape: {extra_info[shape]}",
                       request(shape="circle"), "Red.", "question")
    assert text == "Q: What colour is the shape? | A: Red. | truth: red | shape: circle"


def test_a_template_reading_what_the_row_lacks_says_which_key():
    with pytest.raises(ValueError, match=r"extra_info\['problem'\].*set reward.judge.question_key"):
        render_text("{question} {response}", request(), "red", "problem")
    with pytest.raises(ValueError, match="'shape'"):
        render_text("{extra_info[shape]} {response}", request(), "red", "question")


# ---------------------------------------------------------------------------------------------------- combination


def test_the_weighted_reward_is_rule_and_judge_and_a_failed_sample_gets_no_judge_advantage():
    rule = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    verdicts = [vlmrl.rewards.judge.Verdict(s) for s in (0.9, 0.1, None, 0.5, None, None)]
    values, parts = combine(rule, [{FAILED_KEY: 0.0, "accuracy": r} for r in rule], verdicts, n=2, weight=0.25)
    for value, part in zip(values, parts):  # every row: reward = (1 - w) * rule + w * judge
        assert value == pytest.approx(0.75 * part["rule"] + 0.25 * part["judge"])
        assert part[FAILED_KEY] == part["judge_failed"]
    assert parts[2]["judge"] == 0.5  # its group's mean: the judge moves only its peer's advantage
    assert parts[4]["judge"] == parts[5]["judge"] == pytest.approx((0.9 + 0.1 + 0.5) / 3)  # a whole group failed
    assert [p["judge_failed"] for p in parts] == [0, 0, 1, 0, 1, 1]
    assert parts[0]["accuracy"] == 1.0  # the rule's own parts stay


# ---------------------------------------------------------------------------------------------------- real failures


def test_an_unreachable_judge_stops_the_run_at_start_naming_the_url():
    url = f"http://127.0.0.1:{closed_port()}"
    began = time.monotonic()
    with pytest.raises(JudgeError, match=f"the judge endpoint {url} does not answer"):
        start_judge(JudgeConfig(enable=True, url=url))
    assert time.monotonic() - began < 10


def test_a_judge_that_fails_at_start_ends_the_reward_workers_started_before_it(caplog):
    """The run's reward starts its worker processes, then its judge: a judge that does not answer stops the run, and
    the workers already started go with it."""
    before = reward_workers()
    config = RewardConfig(function="synthetic", timeout_s=5, num_workers=2,
                          judge=JudgeConfig(enable=True, url=f"http://127.0.0.1:{closed_port()}"))
    with caplog.at_level(logging.INFO, logger="vlmrl.rewards.workers"), pytest.raises(JudgeError):
        RewardScorer.start(config, ["synthetic/colour"])
    assert "reward: 2 worker process(es)" in caplog.text, "the workers had started"
    assert reward_workers() <= before


def test_a_judge_that_goes_away_fails_its_samples_after_retries_and_they_are_counted():
    url = f"http://127.0.0.1:{closed_port()}"
    config = RewardConfig(function="synthetic", timeout_s=0,
                          judge=JudgeConfig(enable=True, url=url, model="judge", max_retries=2, retry_backoff_s=0.2,
                                            weight=0.5))
    judge = Judge(config.judge)  # as if it had answered at start and then died
    requests = [request("red"), request("blue", answer="blue")]
    began = time.monotonic()
    scores = score_texts(get_reward_fn("synthetic"), requests, ["red", "green", "blue", "blue"], 2, config,
                         judge=judge)
    assert time.monotonic() - began >= 0.2 + 0.4  # each request waited out both backoffs
    assert scores.failures == 4
    # the two "blue" answers to one prompt are one request; each took 1 try + 2 retries
    assert judge.stats.requests == 3 and judge.stats.attempts == 3 * 3
    assert [p["judge_failed"] for p in scores.parts] == [1.0] * 4
    assert [p[FAILED_KEY] for p in scores.parts] == [1.0] * 4
    # nothing was judged: the judge part is 0 everywhere, so the reward is the rule's share alone
    assert scores.values == [0.5, 0.0, 0.5, 0.5]
    # a failure is not cached: the next batch asks again
    score_texts(get_reward_fn("synthetic"), requests[:1], ["red", "red"], 2, config, judge=judge)
    assert judge.stats.requests == 4
    judge.close()
    judge.close()  # safe twice
    with pytest.raises(RuntimeError, match="is closed"):
        judge.score(requests[:1], ["red"], 1)
    assert judge.stats.requests == 4, "a closed judge sends nothing"


def test_a_judge_that_never_answers_times_out_each_attempt():
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        judge = Judge(JudgeConfig(enable=True, url=url, model="judge", timeout_s=0.3, max_retries=1,
                                  retry_backoff_s=0.0))
        began = time.monotonic()
        verdicts = judge.score([request()], ["red"], 1)
        elapsed = time.monotonic() - began
        judge.close()
    assert verdicts[0].score is None and "no reply" in verdicts[0].error and "within reward.judge.timeout_s=0.3" \
        in verdicts[0].error
    assert judge.stats.attempts == 2 and 0.6 <= elapsed < 5


class _Judge:
    """A judge endpoint on 127.0.0.1 that answers every request with one chat completion rating [[7]], either at once
    or `step` bytes every `pause_s` seconds (a slow judge, or a proxy that trickles its replies). It stops with the
    test: a bounded number of connections, each served on its own thread."""

    def __init__(self, step: int = 0, pause_s: float = 0.0, connections: int = 8):
        import threading

        reply = json.dumps({"choices": [{"message": {"content": "Right. Rating: [[7]]"}, "finish_reason": "stop"}]})
        self.body = reply.encode()
        self.step, self.pause_s = step or len(self.body), pause_s
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(connections)
        self.server.settimeout(30)
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(connections,), daemon=True)
        self.thread.start()

    def _serve(self, connections: int) -> None:
        import threading

        for _ in range(connections):
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed, or nothing came within the accept timeout
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head, _, body = request.partition(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                while len(body) < length:
                    body += conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(self.body))
                for start in range(0, len(self.body), self.step):
                    if self.stopped.wait(self.pause_s if start else 0):
                        return
                    conn.sendall(self.body[start:start + self.step])
            except OSError:  # the client gave up on the reply: what the timeout does
                return

    def close(self) -> None:
        self.stopped.set()
        self.server.close()


@pytest.mark.parametrize("trickled", [False, True])
def test_a_reply_still_arriving_at_the_timeout_is_cut_and_counted_as_a_timeout(trickled):
    """reward.judge.timeout_s bounds the whole reply, not each read: the same completion trickled a few bytes at a
    time over about 2 s (each read well within the timeout) fails its sample as a timeout at timeout_s=0.5, where it
    answered at once it scores."""
    endpoint = _Judge(step=8, pause_s=0.2) if trickled else _Judge()
    try:
        judge = Judge(JudgeConfig(enable=True, url=endpoint.url, model="judge", timeout_s=0.5, max_retries=0))
        (verdict,) = judge.score([request()], ["red"], 1)
        judge.close()
    finally:
        endpoint.close()
    if trickled:
        assert verdict.score is None and "within reward.judge.timeout_s=0.5" in verdict.error, verdict
        assert judge.stats.timeouts == 1 and judge.stats.failures == 1
    else:
        assert verdict.score == pytest.approx(0.7) and judge.stats.timeouts == 0
