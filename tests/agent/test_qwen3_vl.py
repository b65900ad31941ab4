"""The agent loop on the embedded Qwen3-VL: a conversation with a text tool and an image tool (a zoomed crop goes
back to the model as a new image) gives the trainer exactly what the Qwen3-VL processor makes of the whole final
conversation: ids, masks, pixel values and grids (16 px patches, factor 32), and Qwen3-VL's own position ids.
The turns are played by the scripted backend (this checks the loop and the processor, not an engine's numbers)."""

from __future__ import annotations

import pytest
import torch

from tests.agent import scripted
from tests.agent.helpers import GREEDY, EchoTool, Lifecycle, P, R, assert_forward_finite, check_long_sample
from vlmrl.agent.builtin import ImageZoomTool
from vlmrl.agent.config import AgentConfig
from vlmrl.agent.loop import AgentLoop
from vlmrl.agent.tools import ToolRegistry


@pytest.fixture(scope="module")
def qwen3_processor(tiny_qwen3_vl_path):
    from vlmrl.processors.loading import load_processor

    return load_processor(tiny_qwen3_vl_path)


@pytest.fixture(scope="module")
def qwen3_model(tiny_qwen3_vl_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl_path, dtype=torch.float32).eval()


def test_tool_images_reach_the_trainer_as_the_processor_renders_them(tiny_qwen3_vl_path, qwen3_processor,
                                                                     qwen3_model):
    from tests.fakes import ScriptedBackend

    processor = qwen3_processor
    with ScriptedBackend(tiny_qwen3_vl_path, scripted.ScriptedModel(processor), max_model_len=1024) as backend:
        with AgentLoop(backend, processor, AgentConfig(), prompt_length=P, response_length=R,
                       tools=ToolRegistry([EchoTool(Lifecycle()), ImageZoomTool()])) as loop:
            batch = loop.run([processor.build_request(scripted.row(scripted.LONG_QUESTION))], GREEDY)
    assert batch.samples
    for agent_sample in batch.samples:
        assert agent_sample.num_turns == 3 and agent_sample.assistant_texts[-1] == scripted.FINAL_ANSWER
        grid = agent_sample.sample.multi_modal_inputs["image_grid_thw"]
        assert grid.shape[0] == 2  # the prompt image and the zoomed crop
        assert all(int(side) % 2 == 0 for side in grid[:, 1:].flatten())  # 16 px patches, 2x2 merged: 32 px sides
        # 112 px is no multiple of 32: the prompt image is resized, the zoom crops the resized image and the loop
        # resizes the crop; the reference renders those images (the HF processor then resizes nothing)
        shown = processor.build_request(scripted.row(scripted.LONG_QUESTION)).images[0]
        crop = processor.prepare_image(shown.crop(tuple(scripted.ZOOM_BOX)), "the crop")
        check_long_sample(agent_sample, processor, qwen3_model, rollout_logprobs=False, images=[shown, crop])
        # and the trainer's forward on it runs: Qwen3-VL's deepstack features go to both images' tokens
        assert_forward_finite(qwen3_model, agent_sample)
