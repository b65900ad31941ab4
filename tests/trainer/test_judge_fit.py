"""The judge reward end to end: the CPU demo (examples/configs/tiny_synthetic_judge.yaml, shortened) trains with a
tiny SGLang judge that vlmrl launches and ends, its scores in metrics.jsonl; and a judge whose replies never give a
score fails every sample, counted, while the run goes on with the rule reward's share."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from vlmrl.config import load_config
from vlmrl.rewards.config import JudgeServerConfig
from vlmrl.rewards.judge_server import launch_judge_server
from vlmrl.trainer.fit import fit
from vlmrl.trainer.metrics import read_metrics

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
SHORT = ["data.synthetic_train_size=64", "data.synthetic_val_size=8", "data.train_batch_size=4", "rollout.n=4",
         "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=16", "trainer.format_warmup_steps=0",
         "trainer.save_freq=-1", "trainer.logger=[console]"]


def judge_servers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if any("sglang.launch_server" in part for part in p.cmdline())]


def weighted(row: dict, weight: float) -> float:
    """reward/mean as the weighting gives it from the logged parts' means (linear, over the same rows)."""
    return (1 - weight) * row["reward_extra/rule/mean"] + weight * row["reward_extra/judge/mean"]


# A variant (marker `full`, make test-all; 70 s, most of it the judge server's start): make test keeps a launched judge
# scoring images and answers, combined with the rule reward and closed with the reward
# (tests/rewards/test_judge_server.py), and the reward workers in the fit loop (tests/trainer/test_fit.py).
@pytest.mark.vllm
@pytest.mark.full
def test_the_judge_demo_trains_with_a_launched_judge_and_its_scores_reach_the_metrics(tmp_path):
    out = tmp_path / "demo"
    fit(load_config([f"config={CONFIGS / 'tiny_synthetic.yaml'}", f"config={CONFIGS / 'tiny_synthetic_judge.yaml'}",
                     *SHORT, "trainer.total_steps=3", "trainer.test_freq=3", f"trainer.output_dir={out}"]))
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        assert 0 < row["reward_extra/judge/mean"] < 1, row
        assert row["reward_extra/judge_failed/mean"] == 0 and row["reward/failures"] == 0
        assert row["reward/mean"] == pytest.approx(weighted(row, 0.5))
        assert "reward_extra/judge_cached/mean" in row and row["timing/reward"] > 0
    for row in (rows[0], rows[3]):  # validation is judged too
        assert 0 < row["val/reward_extra/judge"] < 1 and row["val/reward_failures"] == 0
    assert not judge_servers(), "the run ends its judge server"


# A variant (marker `full`, make test-all): the failure counting itself runs in make test on a real server
# (tests/rewards/test_judge_server.py: free text that gives no score fails every sample, counted) and on a closed
# port (tests/rewards/test_judge.py); this one shows a whole run going on through it.
@pytest.mark.full
def test_a_judge_that_gives_no_score_fails_every_sample_counted_and_the_run_goes_on(tiny_model_path, tmp_path):
    rule = tmp_path / "length_reward.py"  # a rule reward that is not 0 on an untrained policy
    rule.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return min(len(solution_str), 10) / 10\n")
    server = launch_judge_server(JudgeServerConfig(model_path=tiny_model_path, max_model_len=1024))
    out = tmp_path / "unparsed"
    try:
        fit(load_config([
            f"actor.model_path={tiny_model_path}", "data.train_files=synthetic", "data.max_prompt_length=64",
            "data.max_response_length=4", "rollout.name=hf", *SHORT, "trainer.total_steps=2",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.torch_threads=1",
            f"trainer.output_dir={out}", f"reward.function={rule}:compute_score", "reward.judge.enable=true",
            f"reward.judge.url={server.url}", "reward.judge.mode=generate", "reward.judge.max_tokens=8",
            "reward.judge.weight=0.5"]))  # the random-init judge never writes "[[N]]"
    finally:
        server.close()
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["reward/failures"] == row["batch/real_rows"] == 16
        assert row["reward_extra/judge_failed/mean"] == 1 and row["reward_extra/reward_failed/mean"] == 1
        # nothing judged: the judge part is 0 for all, the reward is the rule's half (no made-up verdict)
        assert row["reward_extra/judge/mean"] == 0
        assert row["reward/mean"] == pytest.approx(0.5 * row["reward_extra/rule/mean"]) and row["reward/mean"] > 0
