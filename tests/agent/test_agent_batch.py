"""What the trainer reads of a finished agent rollout: the padded samples, the final answers the reward scores, and
the samples as rollout results (validation's metrics and artifact). No engine: the samples are padded by hand."""

from __future__ import annotations

import torch

from vlmrl.agent.loop import AgentBatch
from vlmrl.agent.trajectory import AgentSample
from vlmrl.batch.padding import pad_sample
from vlmrl.types import PromptInputs, RolloutRequest, RolloutResult

P, R, PAD = 4, 6, 0


def _agent_sample(uid: str, index: int, response: list[int], texts: list[str], logprobs: bool = True) -> AgentSample:
    prompt = PromptInputs(uid, torch.tensor([11, 12]), torch.arange(2).expand(3, 2).clone())
    sample = pad_sample(prompt, response, prompt_length=P, response_length=R, pad_token_id=PAD,
                        response_mask=[1.0] + [0.0] * (len(response) - 2) + [1.0],
                        rollout_logprobs=[-0.5] * len(response) if logprobs else None, finish_reason="stop")
    return AgentSample(sample, torch.zeros(R, dtype=torch.long), index, len(texts), "no_tool_call", texts, {})


def test_final_answers_results_and_train_samples_follow_the_samples():
    samples = [_agent_sample("g", 0, [5, 6, 7, 8], ["<tool_call>zoom</tool_call>", "red"]),
               _agent_sample("g", 1, [5, 9], [], logprobs=False)]
    batch = AgentBatch([RolloutRequest(uid="g", prompt_ids=[11, 12])], samples, {})
    assert batch.final_answers == ["red", ""], "the last assistant turn, not the tool reply; nothing when no turn"
    assert batch.train_samples == [s.sample for s in samples]
    assert batch.results == [RolloutResult("g", 0, [5, 6, 7, 8], [-0.5] * 4, "stop"),  # tool tokens included
                             RolloutResult("g", 1, [5, 9], [0.0, 0.0], "stop")]
