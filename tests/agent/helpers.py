"""Tools and checks shared by the agent tests (HF and engine backends run the same checks)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections import defaultdict

import numpy as np
import torch

from tests.agent import scripted
from vlmrl.agent.builtin import ImageZoomTool
from vlmrl.agent.carry import TRAJECTORY_FIELDS
from vlmrl.agent.tools import Tool, ToolContext
from vlmrl.agent.trajectory import AgentSample
from vlmrl.types import SamplingParams

P, R = 128, 256
"""Padded prompt and response lengths of the agent tests' loops."""
GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=64)


class Lifecycle:
    """Records every lifecycle call per trajectory: {trajectory_id: ["create", "execute", ..., "release"]}."""

    def __init__(self):
        self.events: dict[str, list[str]] = defaultdict(list)
        self._lock = threading.Lock()

    def add(self, trajectory: str, event: str) -> None:
        with self._lock:
            self.events[trajectory].append(event)


class EchoTool(Tool):
    """Returns its `text` argument. mode: "ok", "raise", "block" (a plain method that never returns in time)."""

    name = "echo"

    def __init__(self, log: Lifecycle | None = None, mode: str = "ok"):
        self.log, self.mode = log or Lifecycle(), mode
        self.unblock = threading.Event()

    def create(self, context: ToolContext) -> str:
        self.log.add(context.trajectory_id, "create")
        return context.trajectory_id

    def execute(self, state: str, arguments: dict) -> str:
        self.log.add(state, "execute")
        if self.mode == "raise":
            raise RuntimeError("echo is broken")
        if self.mode == "block":
            self.unblock.wait(60)  # released by the test when it ends; the loop must not wait for it
        return arguments["text"]

    def reward(self, state: str) -> float:
        self.log.add(state, "reward")
        return 0.5

    def release(self, state: str) -> None:
        self.log.add(state, "release")


class CountingEcho(EchoTool):
    """EchoTool on the event loop (no thread timing, so every run batches the turns alike) whose state counts its
    calls: a state that `create` cannot rebuild, saved with save_state."""

    async def create(self, context):
        return {"trajectory": EchoTool.create(self, context), "calls": 0}

    async def execute(self, state, arguments):
        state["calls"] += 1
        return EchoTool.execute(self, state["trajectory"], arguments)

    async def reward(self, state):
        return EchoTool.reward(self, state["trajectory"])

    async def release(self, state):
        EchoTool.release(self, state["trajectory"])

    def save_state(self, state):
        return dict(state)

    def load_state(self, context, saved):
        self.log.add(saved["trajectory"], "load_state")
        return dict(saved)


class AsyncZoom(ImageZoomTool):
    """The zoom tool on the event loop; it saves no state (create rebuilds it from the prompt's images)."""

    async def create(self, context):
        return ImageZoomTool.create(self, context)

    async def execute(self, state, arguments):
        return ImageZoomTool.execute(self, state, arguments)


class HangingZoomTool(ImageZoomTool):
    """The zoom tool with an async execute that never finishes (cancelled by the loop's timeout)."""

    async def execute(self, state, arguments):
        await asyncio.Event().wait()


def requests(processor, *questions: str) -> list:
    """One RolloutRequest per scripted question (each with the scripted prompt image)."""
    return [processor.build_request(scripted.row(q)) for q in questions]


def full_ids(sample) -> torch.Tensor:
    """(L,) the unpadded prompt + response of a padded Sample."""
    p_len = sample.prompt_ids.shape[0]
    return torch.cat([sample.prompt_ids[sample.attention_mask[:p_len].bool()],
                      sample.response_ids[sample.attention_mask[p_len:].bool()]])


def tool_turn_texts(agent_sample: AgentSample, tokenizer) -> list[str]:
    """The text of each tool turn (runs of response_mask 0 inside the real response)."""
    s = agent_sample.sample
    real = s.attention_mask[s.prompt_ids.shape[0]:].bool()
    ids, mask = s.response_ids[real].tolist(), s.response_mask[real].tolist()
    turns, current = [], []
    for token, m in zip(ids, mask):
        if m == 0:
            current.append(token)
        elif current:
            turns.append(tokenizer.decode(current))
            current = []
    if current:
        turns.append(tokenizer.decode(current))
    return turns


def hf_rope_index(hf_model, input_ids: torch.Tensor, grid: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """transformers' own get_rope_index on (1, L) ids: (3, 1, L)."""
    positions, _ = hf_model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == image_token_id).to(torch.int32), image_grid_thw=grid,
        attention_mask=torch.ones_like(input_ids))
    return positions


def check_long_sample(agent_sample: AgentSample, processor, hf_model, rollout_logprobs: bool = True,
                      images: list | None = None) -> None:
    """The LONG trajectory equals the processor run on the full final conversation: ids, response_mask, image
    inputs, position ids; and (rollout_logprobs: a real backend wrote them) the trainer's forward on the padded sample
    reproduces the rollout logprobs. images: the conversation's two images as shown (default: the prompt image and its
    zoomed quarter, which the tiny Qwen2.5-VL takes unresized)."""
    s = agent_sample.sample
    image = scripted.prompt_image()
    images = images or [image, image.crop(tuple(scripted.ZOOM_BOX))]
    ref = scripted.reference(processor, scripted.long_conversation(), images)
    ids = full_ids(s)
    assert ids.tolist() == ref.input_ids[: ref.length].tolist(), (
        "conversation differs from the template rendering:\n"
        f"loop: {processor.tokenizer.decode(ids)!r}\nref:  {processor.tokenizer.decode(ref.input_ids)!r}")
    p_len = s.prompt_ids.shape[0]
    real = s.attention_mask[p_len:].bool()
    assert int(s.attention_mask[:p_len].sum()) == ref.prompt_length
    assert s.response_mask[real].tolist() == ref.assistant_mask[ref.prompt_length: ref.length].float().tolist()
    assert float(s.response_mask[~real].sum()) == 0.0
    assert torch.equal(s.multi_modal_inputs["image_grid_thw"], ref.image_grid_thw)
    assert torch.allclose(s.multi_modal_inputs["pixel_values"], ref.pixel_values, atol=1e-6)
    expected_pos = hf_rope_index(hf_model, ref.input_ids[None, : ref.length], ref.image_grid_thw,
                                 processor.image_token_id)[:, 0]
    attended = s.attention_mask.bool()
    assert torch.equal(s.position_ids[:, attended], expected_pos), "position ids differ from get_rope_index"
    assert float(s.position_ids[:, ~attended].abs().sum()) == 0
    if not rollout_logprobs:
        return

    # The trainer's forward on the padded row (explicit position ids) gives back the rollout logprobs: tool turns and
    # the tool image did not shift anything the policy tokens were generated from.
    with torch.no_grad():
        input_ids = torch.cat([s.prompt_ids, s.response_ids])[None]
        logits = hf_model(input_ids=input_ids, attention_mask=s.attention_mask[None],
                          position_ids=s.position_ids[:, None], pixel_values=s.multi_modal_inputs["pixel_values"],
                          image_grid_thw=s.multi_modal_inputs["image_grid_thw"], use_cache=False).logits[0].float()
    logprobs = torch.log_softmax(logits[p_len - 1: -1], -1).gather(1, s.response_ids[:, None])[:, 0]
    policy = s.response_mask.bool()
    torch.testing.assert_close(logprobs[policy], s.rollout_logprobs[policy], atol=2e-4, rtol=0)
    assert float(s.rollout_logprobs[~policy].abs().sum()) == 0


def pixels(image) -> tuple:
    return image.mode, image.size, np.asarray(image).tobytes()


def assert_same_sample(a, b, where: str) -> None:
    """Two AgentSamples are equal in every tensor and field the trainer or the metrics read."""
    for name, value in vars(a.sample).items():
        other = getattr(b.sample, name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), f"{where}: sample.{name} differs"
        elif name == "multi_modal_inputs":
            assert value.keys() == other.keys(), where
            assert all(torch.equal(value[k], other[k]) for k in value), f"{where}: pixel values / grids differ"
        else:
            assert value == other, f"{where}: sample.{name} {value!r} != {other!r}"
    assert torch.equal(a.token_versions, b.token_versions), f"{where}: token versions differ"
    assert (a.sample_index, a.num_turns, a.end_reason, a.assistant_texts, a.counters) == \
           (b.sample_index, b.num_turns, b.end_reason, b.assistant_texts, b.counters), where


def assert_same_groups(restored, original) -> None:
    assert [g.request.uid for g in restored] == [g.request.uid for g in original]
    for got, want in zip(restored, original):
        uid = want.request.uid
        for field in dataclasses.fields(want.request):
            value = getattr(want.request, field.name)
            if field.name == "images":
                assert [pixels(im) for im in got.request.images] == [pixels(im) for im in value], uid
            elif field.name == "videos":
                assert [(v.frames.tobytes(), v.frames.shape, v.fps, v.frame_indices, v.total_frames, v.hash)
                        for v in got.request.videos] == \
                       [(v.frames.tobytes(), v.frames.shape, v.fps, v.frame_indices, v.total_frames, v.hash)
                        for v in value], f"group {uid}: request.videos"
            else:
                assert getattr(got.request, field.name) == value, f"group {uid}: request.{field.name}"
        assert got.resumed and len(got.trajectories) == len(want.trajectories)
        for t_got, t_want in zip(got.trajectories, want.trajectories):
            for name in TRAJECTORY_FIELDS:
                assert getattr(t_got, name) == getattr(t_want, name), f"trajectory {t_want.key}: {name}"
            assert [pixels(im) for im in t_got.tool_images] == [pixels(im) for im in t_want.tool_images]
            assert t_got.tool_states.keys() == t_want.tool_states.keys()
            if not t_want.done:
                assert t_got.tool_states["echo"] == t_want.tool_states["echo"]  # its call count came back
                assert [pixels(im) for im in t_got.tool_states["zoom"].images] == \
                       [pixels(im) for im in t_want.tool_states["zoom"].images]
        assert sorted(got.samples) == sorted(want.samples)
        for index, sample in want.samples.items():
            assert_same_sample(got.samples[index], sample, f"group {uid} sample {index}")


def assert_forward_finite(model, agent_sample) -> None:
    """The model's forward on a padded agent sample (explicit position ids, all its images) gives finite logits."""
    s = agent_sample.sample
    with torch.no_grad():
        logits = model(input_ids=torch.cat([s.prompt_ids, s.response_ids])[None], attention_mask=s.attention_mask[None],
                       position_ids=s.position_ids[:, None], **s.multi_modal_inputs, use_cache=False).logits
    assert torch.isfinite(logits).all()
