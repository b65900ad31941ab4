"""The agent loop on the embedded Qwen3.5: a conversation with a text tool and an image tool gives the trainer exactly
what the Qwen3.5 processor makes of the whole final conversation (ids, masks, pixel values, grids, position ids), and
the hybrid model's forward runs on it. The turns are played by the scripted backend (the loop and the processor, not
an engine's numbers; the engines' Qwen3.5 contract is in tests/rollout/qwen3_5)."""

from __future__ import annotations

import torch

from tests.agent import scripted
from tests.agent.helpers import GREEDY, EchoTool, Lifecycle, P, R, assert_forward_finite, check_long_sample
from vlmrl.agent.builtin import ImageZoomTool
from vlmrl.agent.config import AgentConfig
from vlmrl.agent.loop import AgentLoop
from vlmrl.agent.tools import ToolRegistry


def test_a_tool_conversation_reaches_the_trainer_as_the_processor_renders_it(tiny_qwen3_5_path):
    from transformers import AutoModelForImageTextToText

    from tests.fakes import ScriptedBackend
    from vlmrl.processors.loading import load_processor

    processor = load_processor(tiny_qwen3_5_path)
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_5_path, dtype=torch.float32).eval()
    with ScriptedBackend(tiny_qwen3_5_path, scripted.ScriptedModel(processor), max_model_len=1024) as backend:
        with AgentLoop(backend, processor, AgentConfig(), prompt_length=P, response_length=R,
                       tools=ToolRegistry([EchoTool(Lifecycle()), ImageZoomTool()])) as loop:
            batch = loop.run([processor.build_request(scripted.row(scripted.LONG_QUESTION))], GREEDY)
    assert processor.family.name == "Qwen3.5" and batch.samples
    for agent_sample in batch.samples:
        assert agent_sample.num_turns == 3 and agent_sample.assistant_texts[-1] == scripted.FINAL_ANSWER
        assert agent_sample.sample.multi_modal_inputs["image_grid_thw"].shape[0] == 2  # the prompt image + the crop
        shown = processor.build_request(scripted.row(scripted.LONG_QUESTION)).images[0]
        crop = processor.prepare_image(shown.crop(tuple(scripted.ZOOM_BOX)), "the crop")
        check_long_sample(agent_sample, processor, model, rollout_logprobs=False, images=[shown, crop])
        assert_forward_finite(model, agent_sample)
