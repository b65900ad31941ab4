"""Reward time limits: a hung reward function is stopped (its worker process killed and replaced), the sample scores 0
flagged as a timeout, and the rest of the batch, the next batch and the run go on. Real worker processes throughout."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

import vlmrl.rewards.workers
from vlmrl.config import ConfigError, load_config
from vlmrl.rewards.base import FAILED_KEY, TIMEOUT_KEY, RewardInput
from vlmrl.rewards.registry import get_reward_fn
from vlmrl.rewards.scoring import compute_rewards
from vlmrl.rewards.workers import close_reward_workers, workers_for

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
    yield get_reward_fn(f"{path}:compute_score")
    close_reward_workers()


def _items(*responses: str) -> list[RewardInput]:
    return [RewardInput("mine", response, "x") for response in responses]


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie waiting to be reaped by whoever adopted it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hung_sample_scores_zero_flagged_as_a_timeout_and_the_rest_score(reward_fn, caplog):
    with caplog.at_level(logging.WARNING, logger="vlmrl.rewards.scoring"):
        scores, extras, failures = compute_rewards(reward_fn, _items("ab", "hang", "abc", "spin", "a", "abcd"),
                                                   timeout_s=LIMIT, num_workers=2)
    assert scores == [0.2, 0.0, 0.3, 0.0, 0.1, 0.4]
    assert [e[TIMEOUT_KEY] for e in extras] == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert [e[FAILED_KEY] for e in extras] == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0], "a timeout is a failure too"
    assert failures == 2
    assert [e["accuracy"] for e in extras] == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0], "every sample carries the same keys"
    assert all(e["pid"] != os.getpid() for e in extras if e[FAILED_KEY] == 0.0), "scored in worker processes"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one line per batch"
    assert "2 of 6" in warnings[0] and "'hang'" in warnings[0] and f"reward.timeout_s={LIMIT:g}" in warnings[0]


def test_the_stopped_worker_is_gone_and_the_pool_scores_the_next_batch(reward_fn):
    pool = workers_for(reward_fn, 1)
    first = pool.pids[0]
    scores, extras, _ = compute_rewards(reward_fn, _items("hang", "ab"), timeout_s=LIMIT, num_workers=1)
    assert scores == [0.0, 0.2] and extras[0][TIMEOUT_KEY] == 1.0
    assert not _alive(first), "the hung worker must be killed, not abandoned"
    assert workers_for(reward_fn, 1) is pool and pool.pids[0] != first
    assert extras[1]["pid"] == pool.pids[0], "a fresh worker scored the rest of the chunk"
    scores, extras, failures = compute_rewards(reward_fn, _items("abc", "a"), timeout_s=LIMIT, num_workers=1)
    assert (scores, failures) == ([0.3, 0.1], 0)
    assert {e["pid"] for e in extras} == {pool.pids[0]}, "the replacement persists: no process per batch"


def test_a_raising_function_and_a_dying_worker_are_failures_not_timeouts(reward_fn, caplog):
    with caplog.at_level(logging.WARNING, logger="vlmrl.rewards.scoring"):
        scores, extras, failures = compute_rewards(reward_fn, _items("raise", "ab", "exit", "a"),
                                                   timeout_s=LIMIT, num_workers=1)
    assert (scores, failures) == ([0.0, 0.2, 0.0, 0.1], 2)
    assert [e[FAILED_KEY] for e in extras] == [1.0, 0.0, 1.0, 0.0]
    assert [e[TIMEOUT_KEY] for e in extras] == [0.0, 0.0, 0.0, 0.0]
    assert "grader crashed" in caplog.text, "the worker's traceback reaches the log"
    assert "2 of 4" in caplog.text


def test_without_a_limit_the_function_runs_in_this_process_as_before(reward_fn):
    for limit in (None, 0):
        scores, extras, failures = compute_rewards(reward_fn, _items("ab", "raise"), timeout_s=limit)
        assert (scores, failures) == ([0.2, 0.0], 1)
        assert extras == [{"accuracy": 1.0, "pid": os.getpid(), FAILED_KEY: 0.0},
                          {"accuracy": 0.0, "pid": 0.0, FAILED_KEY: 1.0}], "no reward_timeout key without a limit"
    assert vlmrl.rewards.workers._pool is None, "no worker process was started"


def test_built_in_and_module_functions_run_in_workers():
    try:
        fn = get_reward_fn("auto", data_sources=["synthetic/colour"])
        items = [RewardInput("synthetic/colour", text, "red") for text in ("red", "blue", "Red.")]
        assert compute_rewards(fn, items, timeout_s=5, num_workers=2)[0] == [1.0, 0.0, 1.0]
    finally:
        close_reward_workers()


def test_a_function_that_cannot_run_in_a_worker_is_refused_at_start_saying_what_to_change():
    def local_reward(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    for fn in (local_reward, lambda **kwargs: 1.0):
        with pytest.raises(ValueError, match=r"cannot run in a reward worker.*reward.timeout_s=0"):
            workers_for(fn, 1)
    assert compute_rewards(local_reward, _items("a"), timeout_s=0)[0] == [1.0], "in-process still takes it"


def test_workers_end_with_their_parent_even_in_the_middle_of_a_sample(tmp_path):
    # A parent killed by SIGKILL cannot clean up; its worker, stuck in `hang`, must not live on.
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    script = textwrap.dedent(f"""
        from vlmrl.rewards.base import RewardInput
        from vlmrl.rewards.registry import get_reward_fn
        from vlmrl.rewards.scoring import compute_rewards
        from vlmrl.rewards.workers import workers_for
        fn = get_reward_fn({str(path)!r} + ":compute_score")
        print(workers_for(fn, 1).pids[0], flush=True)
        compute_rewards(fn, [RewardInput("mine", "hang", "x")], timeout_s=3600, num_workers=1)
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
    fit(load_config(_run_args(tiny_model_path, tmp_path / "train", str(reward))))
    rows = read_metrics(tmp_path / "train" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    # Validation, 8 samples: the 7th hangs; its replacement scores the 8th and carries that count into training.
    assert rows[0]["val/reward_timeouts"] == 1 and rows[0]["val/reward_extra/reward_timeout"] == 1 / 8
    assert rows[0]["val/reward_failures"] >= 1
    # Training, 16 samples: calls 2..7 (the 6th sample hangs), then 7 more (the 13th hangs), then 3: 2 timeouts.
    assert rows[1]["reward/timeouts"] == 2 and rows[1]["reward_extra/reward_timeout/mean"] == 2 / 16
    assert rows[1]["reward/failures"] >= 2
    assert vlmrl.rewards.workers._pool is None, "the run closed its reward workers"

    metrics = fit(load_config(_run_args(tiny_model_path, tmp_path / "val", str(reward), "trainer.val_only=true",
                                        "data.train_files=")))
    assert metrics["val/reward_timeouts"] == 1 and metrics["val/num_samples"] == 8
    assert vlmrl.rewards.workers._pool is None
