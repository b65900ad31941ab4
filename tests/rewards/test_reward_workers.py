"""Reward time limits: a hung reward function is stopped (its worker process killed and replaced), the sample scores 0
flagged as a timeout, and the rest of the batch, the next batch and the run go on. The pool belongs to its owner (a
run's reward): closed, it scores no more and leaves no process; two runs in one process have two pools. Real worker
processes throughout."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from vlmrl.config import ConfigError, load_config
from vlmrl.rewards.base import FAILED_KEY, TIMEOUT_KEY, RewardInput
from vlmrl.rewards.registry import get_reward_fn
from vlmrl.rewards.scoring import compute_rewards
from vlmrl.rewards.workers import RewardWorkers

from tests.rewards.processes import broken_tool, reward_workers

LIMIT = 1.0  # seconds per sample: short, but far above what the well-behaved samples here take (~1 ms)

# A user's reward file: `hang` sleeps forever, `spin` loops forever holding the GIL (no thread could stop it), `raise`
# raises, `exit` kills its own process; any other response scores its length / 10 and reports the scoring pid.
REWARD_FILE = """
    import os
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            time.sleep(3600)
        if solution_str == "spin":
            while True:
                pass
        if solution_str == "raise":
            raise RuntimeError("grader crashed")
        if solution_str == "exit":
            os._exit(3)
        return {"score": len(solution_str) / 10, "accuracy": 1.0, "pid": os.getpid()}
"""


@pytest.fixture
def reward_fn(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    return get_reward_fn(f"{path}:compute_score")


@pytest.fixture
def pools():
    """Starts pools as their owner would (`pools(fn, num_workers)`) and closes each after the test."""
    started: list[RewardWorkers] = []

    def start(fn, num_workers: int) -> RewardWorkers:
        started.append(RewardWorkers(fn, num_workers))
        return started[-1]

    yield start
    for pool in started:
        pool.close()


def _items(*responses: str) -> list[RewardInput]:
    return [RewardInput("mine", response, "x") for response in responses]


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie waiting to be reaped by whoever adopted it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hung_sample_scores_zero_flagged_as_a_timeout_and_the_rest_score(reward_fn, pools, caplog):
    pool = pools(reward_fn, 2)
    with caplog.at_level(logging.WARNING, logger="vlmrl.rewards.scoring"):
        scores, extras, failures = compute_rewards(reward_fn, _items("ab", "hang", "abc", "spin", "a", "abcd"),
                                                   timeout_s=LIMIT, workers=pool)
    assert scores == [0.2, 0.0, 0.3, 0.0, 0.1, 0.4]
    assert [e[TIMEOUT_KEY] for e in extras] == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert [e[FAILED_KEY] for e in extras] == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0], "a timeout is a failure too"
    assert failures == 2
    assert [e["accuracy"] for e in extras] == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0], "every sample carries the same keys"
    assert all(e["pid"] != os.getpid() for e in extras if e[FAILED_KEY] == 0.0), "scored in worker processes"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one line per batch"
    assert "2 of 6" in warnings[0] and "'hang'" in warnings[0] and f"reward.timeout_s={LIMIT:g}" in warnings[0]


def test_the_stopped_worker_is_gone_and_the_pool_scores_the_next_batch(reward_fn, pools):
    pool = pools(reward_fn, 1)
    first = pool.pids[0]
    scores, extras, _ = compute_rewards(reward_fn, _items("hang", "ab"), timeout_s=LIMIT, workers=pool)
    assert scores == [0.0, 0.2] and extras[0][TIMEOUT_KEY] == 1.0
    assert not _alive(first), "the hung worker must be killed, not abandoned"
    assert pool.pids[0] != first
    assert extras[1]["pid"] == pool.pids[0], "a fresh worker scored the rest of the chunk"
    scores, extras, failures = compute_rewards(reward_fn, _items("abc", "a"), timeout_s=LIMIT, workers=pool)
    assert (scores, failures) == ([0.3, 0.1], 0)
    assert {e["pid"] for e in extras} == {pool.pids[0]}, "the replacement persists: no process per batch"


def test_a_raising_function_and_a_dying_worker_are_failures_not_timeouts(reward_fn, pools, caplog):
    pool = pools(reward_fn, 1)
    with caplog.at_level(logging.WARNING, logger="vlmrl.rewards.scoring"):
        scores, extras, failures = compute_rewards(reward_fn, _items("raise", "ab", "exit", "a"),
                                                   timeout_s=LIMIT, workers=pool)
    assert (scores, failures) == ([0.0, 0.2, 0.0, 0.1], 2)
    assert [e[FAILED_KEY] for e in extras] == [1.0, 0.0, 1.0, 0.0]
    assert [e[TIMEOUT_KEY] for e in extras] == [0.0, 0.0, 0.0, 0.0]
    assert "grader crashed" in caplog.text, "the worker's traceback reaches the log"
    assert "2 of 4" in caplog.text


def test_without_a_limit_the_function_runs_in_this_process_as_before(reward_fn):
    before = reward_workers()
    for limit in (None, 0):
        scores, extras, failures = compute_rewards(reward_fn, _items("ab", "raise"), timeout_s=limit)
        assert (scores, failures) == ([0.2, 0.0], 1)
        assert extras == [{"accuracy": 1.0, "pid": os.getpid(), FAILED_KEY: 0.0},
                          {"accuracy": 0.0, "pid": 0.0, FAILED_KEY: 1.0}], "no reward_timeout key without a limit"
    assert reward_workers() == before, "no worker process was started"
    with pytest.raises(ValueError, match=r"reward.timeout_s=1 scores in worker processes"):
        compute_rewards(reward_fn, _items("ab"), timeout_s=1)  # a limit and nobody's pool: refused, none started


def test_built_in_and_module_functions_run_in_workers(pools):
    fn = get_reward_fn("auto", data_sources=["synthetic/colour"])
    items = [RewardInput("synthetic/colour", text, "red") for text in ("red", "blue", "Red.")]
    assert compute_rewards(fn, items, timeout_s=5, workers=pools(fn, 2))[0] == [1.0, 0.0, 1.0]


def test_a_function_that_cannot_run_in_a_worker_is_refused_at_start_saying_what_to_change():
    def local_reward(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    before = reward_workers()
    for fn in (local_reward, lambda **kwargs: 1.0):
        with pytest.raises(ValueError, match=r"cannot run in a reward worker.*reward.timeout_s=0"):
            RewardWorkers(fn, 1)
    assert reward_workers() == before, "a refused pool leaves no process"
    assert compute_rewards(local_reward, _items("a"), timeout_s=0)[0] == [1.0], "in-process still takes it"


def test_a_closed_pool_leaves_no_process_and_refuses_to_score(reward_fn):
    pool = RewardWorkers(reward_fn, 2)
    pids = pool.pids
    assert set(pids) <= reward_workers()
    pool.close()
    pool.close()  # closing twice is fine (an error path and the run's close may both close it)
    assert not any(_alive(pid) for pid in pids) and not set(pids) & reward_workers()
    with pytest.raises(RuntimeError, match="reward workers of compute_score are closed"):
        compute_rewards(reward_fn, _items("ab"), timeout_s=LIMIT, workers=pool)


def test_a_batch_that_cannot_be_sent_fails_saying_what_to_change_and_the_next_batch_scores(reward_fn, pools):
    pool = pools(reward_fn, 1)
    first = pool.pids[0]
    unsendable = RewardInput("mine", "ab", "x", extra_info={"grader": lambda: 1})  # a row holding a function
    with pytest.raises(ValueError, match="cannot be sent to a reward worker.*reward.timeout_s=0"):
        compute_rewards(reward_fn, [unsendable], timeout_s=LIMIT, workers=pool)
    assert not _alive(first), "the batch's workers are killed: they may hold half of it"
    scores, extras, failures = compute_rewards(reward_fn, _items("abc"), timeout_s=LIMIT, workers=pool)
    assert (scores, failures) == ([0.3], 0) and extras[0]["pid"] not in (first, os.getpid())


def test_workers_end_with_their_parent_even_in_the_middle_of_a_sample(tmp_path):
    # A parent killed by SIGKILL cannot clean up; its worker, stuck in `hang`, must not live on.
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    script = textwrap.dedent(f"""
        from vlmrl.rewards.base import RewardInput
        from vlmrl.rewards.registry import get_reward_fn
        from vlmrl.rewards.scoring import compute_rewards
        from vlmrl.rewards.workers import RewardWorkers
        fn = get_reward_fn({str(path)!r} + ":compute_score")
        pool = RewardWorkers(fn, 1)
        print(pool.pids[0], flush=True)
        compute_rewards(fn, [RewardInput("mine", "hang", "x")], timeout_s=3600, workers=pool)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    worker = int(parent.stdout.readline())
    time.sleep(0.5)  # let the worker get into the hanging sample
    parent.kill()
    parent.wait()
    for _ in range(200):  # the worker polls for its parent twice a second; allow a loaded machine plenty
        if not _alive(worker):
            break
        time.sleep(0.1)
    assert not _alive(worker), f"worker {worker} outlived its killed parent"


def test_config_keys_are_checked_at_load():
    base = ["actor.model_path=tiny", "data.train_files=synthetic", "data.val_files=synthetic"]
    config = load_config(base, check_model=False)
    assert (config.reward.timeout_s, config.reward.num_workers) == (10.0, 1)
    assert load_config([*base, "reward.timeout_s=null"], check_model=False).reward.timeout_s is None
    with pytest.raises(ConfigError, match=r"reward.timeout_s=-1.0 must be >= 0[\s\S]*reward.num_workers=0 must be"):
        load_config([*base, "reward.timeout_s=-1", "reward.num_workers=0"], check_model=False)


# ---------------------------------------------------------------------------------------------------- in the trainer

# Hangs on every 7th sample one worker scores; a replaced worker counts from 0 again.
COUNTING_REWARD = """
    import time

    calls = [0]

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls[0] += 1
        if calls[0] % 7 == 0:
            time.sleep(3600)
        return float(solution_str.strip() == ground_truth)
"""


def _run_args(model_path: str, output_dir, reward: str, *extra: str) -> list[str]:
    return [f"actor.model_path={model_path}", "data.train_files=synthetic", "data.val_files=synthetic",
            "data.synthetic_train_size=16", "data.synthetic_val_size=8", "data.train_batch_size=4",
            "data.max_prompt_length=64", "data.max_response_length=4", "data.max_pixels=12544",
            "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=16", "rollout.name=hf", "rollout.n=4",
            "trainer.total_steps=1", "trainer.test_freq=-1", "trainer.torch_threads=1",
            f"trainer.output_dir={output_dir}", f"reward.function={reward}:compute_score", "reward.timeout_s=0.5",
            *extra]


@pytest.mark.slow  # two whole runs that wait out their hung rewards' timeouts
def test_training_and_validate_only_runs_go_on_past_hung_rewards_and_log_the_timeouts(tiny_model_path, tmp_path):
    from vlmrl.trainer.fit import fit
    from vlmrl.trainer.metrics import read_metrics

    reward = tmp_path / "counting_reward.py"
    reward.write_text(textwrap.dedent(COUNTING_REWARD))
    before = reward_workers()
    fit(load_config(_run_args(tiny_model_path, tmp_path / "train", str(reward))))
    rows = read_metrics(tmp_path / "train" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    # Validation, 8 samples: the 7th hangs; its replacement scores the 8th and carries that count into training.
    assert rows[0]["val/reward_timeouts"] == 1 and rows[0]["val/reward_extra/reward_timeout"] == 1 / 8
    assert rows[0]["val/reward_failures"] >= 1
    # Training, 16 samples: calls 2..7 (the 6th sample hangs), then 7 more (the 13th hangs), then 3: 2 timeouts.
    assert rows[1]["reward/timeouts"] == 2 and rows[1]["reward_extra/reward_timeout/mean"] == 2 / 16
    assert rows[1]["reward/failures"] >= 2
    assert reward_workers() <= before, "the run closed its reward workers"

    metrics = fit(load_config(_run_args(tiny_model_path, tmp_path / "val", str(reward), "trainer.val_only=true",
                                        "data.train_files=")))
    assert metrics["val/reward_timeouts"] == 1 and metrics["val/num_samples"] == 8
    assert reward_workers() <= before, "validate-only closed its reward workers"


def _scores_with(reward, response: str):
    """One response scored by a run's reward, against a row of the user's reward file."""
    from vlmrl.types import RolloutRequest

    return reward.score([RolloutRequest(uid="r", prompt_ids=[1], data_source="mine", ground_truth="x")], [response], 1)


@pytest.mark.slow  # two runs set up in this process (an HF engine each)
def test_two_runs_in_one_process_have_their_own_reward_workers_and_a_closed_runs_score_no_more(tiny_model_path,
                                                                                                 tmp_path):
    from vlmrl.trainer.setup import setup_run

    reward = tmp_path / "my_reward.py"
    reward.write_text(textwrap.dedent(REWARD_FILE))
    before = reward_workers()
    runs = []
    try:
        for name in ("first", "second"):
            runs.append(setup_run(load_config(_run_args(tiny_model_path, tmp_path / name, str(reward)))))
        first, second = (run.parts.reward for run in runs)
        first_pids, second_pids = first.workers.pids, second.workers.pids
        assert not set(first_pids) & set(second_pids), "each run started its own pool"
        assert _scores_with(first, "ab").parts[0]["pid"] in first_pids
        assert _scores_with(second, "abc").parts[0]["pid"] in second_pids
        runs[0].close()
        assert not any(_alive(pid) for pid in first_pids), "closing a run ends its reward workers"
        with pytest.raises(RuntimeError, match="closed"):
            _scores_with(first, "ab")
        first.close()  # a second close (an error path after the run's own) is harmless
        scores = _scores_with(second, "abcd")
        assert scores.values == [0.4] and scores.parts[0]["pid"] in second_pids, "the other run scores on"
    finally:
        for run in runs:
            run.close()
    assert not any(_alive(pid) for pid in second_pids) and reward_workers() <= before


@pytest.mark.slow  # a run's setup up to its last part (an HF engine)
def test_a_setup_that_fails_after_the_reward_started_ends_its_reward_workers(tiny_model_path, tmp_path, caplog):
    from vlmrl.trainer.setup import setup_run

    reward = tmp_path / "my_reward.py"
    reward.write_text(textwrap.dedent(REWARD_FILE))
    config = load_config(_run_args(tiny_model_path, tmp_path / "run", str(reward), "reward.num_workers=2",
                                   *broken_tool(tmp_path, 4)))
    before = reward_workers()
    with caplog.at_level(logging.INFO, logger="vlmrl.rewards.workers"), \
            pytest.raises(ValueError, match="the sandbox service does not answer"):
        setup_run(config)
    assert "reward: 2 worker process(es) score with compute_score" in caplog.text, "they had started"
    assert reward_workers() <= before, "the failed setup closed the reward workers it had started"
