"""Training with agent.enable: the fit loop rolls out multi-turn conversations with real tool calls (the tiny model
taught the scripted conversations of tests/agent/scripted.py, generating through the hf backend), scores each
trajectory's final answer, trains on it with partial rollout on, and validates through the agent loop."""

from __future__ import annotations

import pytest

from tests.agent.training import teach_model, write_run_files
from tests.trainer.test_fit import STEP_PHASES, assert_timed
from vlmrl.config import load_config
from vlmrl.trainer.fit import fit
from vlmrl.trainer.metrics import read_metrics

AGENT = """
agent:
  enable: true
  tools:
    - path: tests.agent.helpers:EchoTool
    - path: vlmrl.agent.builtin:ImageZoomTool
  max_turns: 4
  max_response_tokens: 256
  partial:
    enable: true
    oversample_factor: 1.5
    unfinished: carry
"""


@pytest.fixture(scope="module")
def taught_model(tiny_model_path, tmp_path_factory) -> str:
    return teach_model(tiny_model_path, tmp_path_factory)


def test_two_agent_steps_with_tool_calls_partial_rollout_and_agent_validation(taught_model, tmp_path):
    data, reward, agent_yaml = write_run_files(tmp_path, AGENT)
    out = tmp_path / "run"
    config = load_config([
        f"config={agent_yaml}", f"actor.model_path={taught_model}", f"data.train_files={data}",
        f"data.val_files={data}", "data.train_batch_size=2", "data.max_prompt_length=96",
        "data.max_response_length=256", "data.max_pixels=12544", "data.shuffle=false",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4", "actor.optim.lr=1e-6",
        "rollout.name=hf", "rollout.n=2", "rollout.temperature=0.05", f"reward.function={reward}:compute_score",
        "trainer.total_steps=2", "trainer.test_freq=2", "trainer.save_freq=2", "trainer.val_before_train=false",
        "trainer.torch_threads=1", f"trainer.output_dir={out}"])
    fit(config)

    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        missing = [k for k in ("agent/turns/mean", "agent/generate_calls", "agent/policy_tokens/mean",
                               "partial/stale_tokens", "partial/finished_groups", "actor/pg_loss",
                               "timing/update") if k not in row]
        assert not missing, f"step {row['step']} lacks {missing}"
        # 4 real rows = one mini-batch would skip the old-logprob pass; partial rollout forces it
        assert "timing/old_logprobs" in row
        assert row["batch/real_rows"] == 4
    # the same timed phases as a plain step: scoring is timed apart from the multi-turn rollout
    assert_timed(rows[0], *STEP_PHASES)
    assert_timed(rows[1], *STEP_PHASES, "validate", "save")
    first = rows[0]
    # The taught model calls echo then zoom on "Look closer." (3 turns) and answers "Answer now." at once.
    assert first["agent/turns/max"] == 3
    assert first["agent/tool/echo/calls/mean"] > 0 and first["agent/tool/zoom/calls/mean"] > 0
    assert first["agent/tool/images/mean"] > 0
    assert first["agent/tool_tokens/mean"] > 0
    # scored on the final assistant turn, so the tool-calling conversations get full reward too
    assert first["reward/mean"] == pytest.approx(1.0)
    assert rows[1]["val/accuracy"] == pytest.approx(1.0) and rows[1]["val/num_samples"] == 2
