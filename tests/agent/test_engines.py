"""The agent loop on the real engines: the same checks as on the HF backend (the engines generate the tool calls,
the trajectory equals the processor's rendering of the whole conversation) and a partial-rollout carry."""

from __future__ import annotations

import pytest

from tests.agent import scripted
from tests.agent.helpers import GREEDY, EchoTool, P, R, check_long_sample, full_ids
from vlmrl.agent.builtin import ImageZoomTool
from vlmrl.agent.config import AgentConfig, PartialRolloutConfig
from vlmrl.agent.loop import AgentLoop
from vlmrl.agent.tools import ToolRegistry
from vlmrl.agent.trajectory import TOOL_VERSION


@pytest.fixture(scope="module", params=[pytest.param("vllm", marks=pytest.mark.vllm),
                                        pytest.param("sglang", marks=pytest.mark.sglang)])
def engine(request, taught_model_path):
    """One engine per module and name (pytest runs every test of one engine before starting the next)."""
    from vlmrl.rollout.registry import get_backend

    with get_backend(request.param, taught_model_path, max_model_len=1024, dtype="float32", timeout_s=120,
                     start_timeout_s=300) as backend:
        yield backend


def tools():
    return ToolRegistry([EchoTool(), ImageZoomTool()])


def test_engine_runs_the_multi_turn_conversation(engine, processor, hf_model):
    with AgentLoop(engine, processor, AgentConfig(), prompt_length=P, response_length=R, tools=tools()) as loop:
        batch = loop.run([processor.build_request(scripted.row(scripted.LONG_QUESTION)),
                          processor.build_request(scripted.row(scripted.SHORT_QUESTION))], GREEDY)
    for agent_sample in batch.samples[:2]:
        assert agent_sample.num_turns == 3 and agent_sample.assistant_texts[-1] == scripted.FINAL_ANSWER
        check_long_sample(agent_sample, processor, hf_model)
    assert [s.assistant_texts for s in batch.samples[2:]] == [[scripted.SHORT_ANSWER]] * 2


def test_engine_partial_rollout_carries_and_finishes(engine, processor):
    config = AgentConfig(partial=PartialRolloutConfig(enable=True, oversample_factor=2.0, chunk_tokens=16))
    with AgentLoop(engine, processor, config, prompt_length=P, response_length=R, tools=tools()) as loop:
        new = [processor.build_request(scripted.row(q)) for q in (scripted.SHORT_QUESTION, scripted.LONG_QUESTION)]
        first = loop.step(new, GREEDY, batch_size=1, policy_version=5)
        assert [r.uid for r in first.requests] == [new[0].uid]
        (carried,) = loop.carried
        before = {t.key: len(t.token_versions) for t in carried.trajectories}
        second = loop.step([], GREEDY, batch_size=1, policy_version=6)
        assert [r.uid for r in second.requests] == [new[1].uid]
        for traj in carried.trajectories:
            cut = before[traj.key]
            assert set(traj.token_versions[:cut]) == {5} | ({TOOL_VERSION} & set(traj.token_versions[:cut]))
            assert 6 in traj.token_versions[cut:] and 5 not in traj.token_versions[cut:]
        assert second.metrics["partial/max_version_lag"] == 1
        plain = loop.run([processor.build_request(scripted.row(scripted.LONG_QUESTION))], GREEDY)
        assert full_ids(second.samples[0].sample).tolist() == full_ids(plain.samples[0].sample).tolist()
