"""Carried partial-rollout groups survive a checkpoint: saved by one loop, restored into a fresh one, they come back
equal (ids, logprobs, version tags, images, turn state, tool states, padded samples) and the next step gives what the
original loop gives when it simply goes on."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from tests.agent import scripted
from tests.agent.helpers import (
    GREEDY,
    AsyncZoom,
    CountingEcho,
    Lifecycle,
    P,
    R,
    assert_same_groups,
    assert_same_sample,
    requests,
)
from vlmrl.agent.builtin import Geo3kAnswerTool
from vlmrl.agent.carry import CARRIED_JSON, CARRIED_TENSORS, PNG_MODES, TRAJECTORY_FIELDS, read_carried, write_carried
from vlmrl.agent.config import AgentConfig, PartialRolloutConfig
from vlmrl.agent.loop import AgentLoop
from vlmrl.agent.tools import ToolContext, ToolRegistry
from vlmrl.agent.trajectory import Trajectory
from vlmrl.processors.images import image_hash
from vlmrl.types import RolloutRequest


def make_loop(backend, processor, log: Lifecycle) -> AgentLoop:
    config = AgentConfig(partial=PartialRolloutConfig(enable=True, oversample_factor=2.0))
    return AgentLoop(backend, processor, config, prompt_length=P, response_length=R,
                     tools=ToolRegistry([CountingEcho(log), AsyncZoom()]))


def test_restored_groups_are_equal_and_the_next_step_matches_the_uninterrupted_loop(scripted_backend, processor,
                                                                                      tmp_path):
    backend = scripted_backend
    log, fresh_log = Lifecycle(), Lifecycle()
    with make_loop(backend, processor, log) as original:
        original.step(requests(processor, *[scripted.SHORT_QUESTION] * 2, *[scripted.LONG_QUESTION] * 2), GREEDY,
                      batch_size=2, policy_version=0)
        # Step 2's first call answers the three SHORT groups (two fill the batch, the third waits finished) and gives
        # the two carried LONG groups their zoom call; they park after the zoom's image comes back.
        original.step(requests(processor, *[scripted.SHORT_QUESTION] * 3), GREEDY, batch_size=2, policy_version=1)
        carried = original.carried
        # What this test relies on: a finished group waiting for a batch (padded again on load) and a group parked
        # mid-conversation after the zoom tool returned an image.
        assert any(g.done for g in carried)
        assert any(not t.done and t.tool_images and t.tool_states["echo"]["calls"] == 1
                   for g in carried for t in g.trajectories)
        assert original.save_carried(tmp_path) == len(carried)

        with make_loop(backend, processor, fresh_log) as resumed:
            assert resumed.restore_carried(tmp_path) == len(carried)
            assert_same_groups(resumed.carried, carried)
            assert resumed.prompts_needed(2) == original.prompts_needed(2)

            new = requests(processor, scripted.SHORT_QUESTION)
            expected = original.step(new, GREEDY, batch_size=2, policy_version=2)
            got = resumed.step(new, GREEDY, batch_size=2, policy_version=2)
            assert [r.uid for r in got.requests] == [r.uid for r in expected.requests]
            assert len(got.samples) == len(expected.samples) == 4
            for i, (a, b) in enumerate(zip(got.samples, expected.samples)):
                assert_same_sample(a, b, f"step 3 sample {i}")
            assert got.metrics == expected.metrics  # staleness, turns, tool counters, backend calls
            assert got.metrics["partial/resumed_groups"] == len(carried)
            assert got.metrics["partial/stale_tokens"] > 0  # tokens of versions 0 and 1 came through the checkpoint
            assert_same_groups(resumed.carried, original.carried)
    # The restored echo states were loaded, not created again; each trajectory still ends with one release.
    restored_keys = {t.key for g in carried for t in g.trajectories if not t.done}
    for key in restored_keys:
        assert fresh_log.events[key][0] == "load_state" and "create" not in fresh_log.events[key]
        assert fresh_log.events[key].count("release") == 1


def test_a_carried_group_with_a_video_resumes_identically(scripted_backend, processor, tiny_model_path, tmp_path):
    """A prompt holding an image and a video (sampled at 1 fps: other timing than the default, which the position
    ids depend on), parked mid-conversation: restored into a fresh loop it has the same frames and timing, and the
    next step gives the uninterrupted loop's samples (video inputs and position ids included)."""
    from vlmrl.data.config import DataConfig
    from vlmrl.data.synthetic import generate_rows
    from vlmrl.processors.loading import load_processor

    video_processor = load_processor(tiny_model_path, DataConfig(video_fps=1.0))
    frames = generate_rows("motion", 1, 0, "val")[0]["videos"][0]

    def video_requests(*questions: str) -> list[RolloutRequest]:
        return [video_processor.build_request(dict(scripted.row(q), videos=[frames], prompt=[
            {"role": "user", "content": "<image><video>" + q}])) for q in questions]

    with make_loop(scripted_backend, processor, Lifecycle()) as original:
        original.step(video_requests(scripted.LONG_QUESTION, scripted.LONG_QUESTION, scripted.SHORT_QUESTION,
                                     scripted.SHORT_QUESTION), GREEDY, batch_size=1, policy_version=0)
        carried = original.carried
        assert carried and all(g.request.videos and g.request.videos[0].sample_fps == 1.0 for g in carried)
        assert any(not t.done for g in carried for t in g.trajectories)
        assert original.save_carried(tmp_path) == len(carried)

        with make_loop(scripted_backend, processor, Lifecycle()) as resumed:
            assert resumed.restore_carried(tmp_path) == len(carried)
            assert_same_groups(resumed.carried, carried)
            new = video_requests(scripted.SHORT_QUESTION)
            expected = original.step(new, GREEDY, batch_size=2, policy_version=1)
            got = resumed.step(new, GREEDY, batch_size=2, policy_version=1)
            assert len(got.samples) == len(expected.samples) == 4
            assert all("pixel_values_videos" in s.sample.multi_modal_inputs for s in got.samples)
            for i, (a, b) in enumerate(zip(got.samples, expected.samples)):
                assert_same_sample(a, b, f"step 2 sample {i}")


def test_a_damaged_video_is_refused_naming_the_checkpoint(processor, tmp_path):
    from safetensors.torch import load_file, save_file

    from vlmrl.data.synthetic import generate_rows

    row = generate_rows("motion", 1, 0, "val")[0]
    request = processor.build_request(row)
    write_carried(tmp_path, [(request, [])], {})
    tensors = load_file(tmp_path / CARRIED_TENSORS)
    tensors["g0/request/video0"][0, 0, 0, 0] ^= 1
    save_file(tensors, tmp_path / CARRIED_TENSORS)
    with pytest.raises(ValueError, match=r"agent_carried.json: video 'g0/request/video0' does not match its saved "
                                         r"hash \(a damaged checkpoint\)"):
        read_carried(tmp_path)


def test_a_folder_without_carried_groups_loads_with_a_log_line(scripted_backend, processor, tmp_path, caplog):
    backend = scripted_backend
    with make_loop(backend, processor, Lifecycle()) as loop, caplog.at_level(logging.WARNING, "vlmrl.agent.loop"):
        assert loop.restore_carried(tmp_path) is None
        assert loop.carried == [] and loop.prompts_needed(2) == 4
    assert "holds no carried partial-rollout groups" in caplog.text

    (tmp_path / CARRIED_JSON).write_text(json.dumps({"format": 99, "groups": []}))
    with make_loop(backend, processor, Lifecycle()) as loop, pytest.raises(ValueError, match="newer vlmrl"):
        loop.restore_carried(tmp_path)


def test_every_trajectory_field_is_saved():
    """A field added to Trajectory must be added to the checkpoint too (or stored apart, like these three)."""
    names = {f.name for f in dataclasses.fields(Trajectory)}
    assert names == set(TRAJECTORY_FIELDS) | {"request", "tool_images", "tool_states"}


def test_the_answer_tool_keeps_its_checked_answers(processor):
    tool = Geo3kAnswerTool()
    context = ToolContext(processor.build_request(scripted.row(scripted.SHORT_QUESTION)), 0)
    state = tool.create(context)
    tool.execute(state, {"answer": "7"})
    tool.execute(state, {"answer": "8"})
    restored = tool.load_state(context, json.loads(json.dumps(tool.save_state(state))))
    assert restored == state and tool.reward(restored) == 0.0


def _image(mode: str, size=(40, 24)) -> Image.Image:
    """A noisy image in `mode` (noise, so that no encoding can get it right by accident)."""
    rng = np.random.default_rng(sum(map(ord, mode)))
    if mode in ("I;16", "F"):
        array = rng.integers(0, 60_000, size[::-1]).astype(np.uint16 if mode == "I;16" else np.float32)
        return Image.fromarray(array, mode=mode) if mode == "F" else Image.frombytes(mode, size, array.tobytes())
    bands = len(Image.new(mode, (1, 1)).getbands())
    array = rng.integers(0, 256, (*size[::-1], bands), dtype=np.uint8)
    return Image.frombytes(mode, size, array.tobytes()) if mode != "1" else Image.fromarray(array[..., 0] > 127)


def _group(images: list[Image.Image], tool_images: list[Image.Image]) -> tuple[RolloutRequest, list[Trajectory]]:
    request = RolloutRequest(uid="u", prompt_ids=[1, 2], images=images, image_hashes=[image_hash(i) for i in images])
    traj = Trajectory(request, 0, response_ids=[3], response_mask=[1], logprobs=[-0.5], token_versions=[0],
                      tool_images=tool_images, tool_image_hashes=[image_hash(i) for i in tool_images])
    return request, [traj]


def test_images_of_every_mode_come_back_byte_for_byte_and_photos_are_stored_compressed(tmp_path):
    modes = ["RGB", "RGBA", "L", "LA", "1", "P", "CMYK", "I;16", "F"]
    tool_images = [_image(m) for m in modes]
    flat = Image.new("RGB", (448, 448), (200, 30, 30))
    write_carried(tmp_path, [_group([flat], tool_images)], {})
    [(request, [traj])], _ = read_carried(tmp_path)
    assert [(im.mode, im.size, im.tobytes()) for im in traj.tool_images] == \
           [(im.mode, im.size, im.tobytes()) for im in tool_images]
    assert request.images[0].tobytes() == flat.tobytes()
    saved = json.loads((tmp_path / CARRIED_JSON).read_text())
    encodings = {item["mode"]: item["encoding"] for item in saved["groups"][0]["trajectories"][0]["tool_images"]}
    assert encodings == {m: "png" if m in PNG_MODES else "raw" for m in modes}
    assert (tmp_path / CARRIED_TENSORS).stat().st_size < len(flat.tobytes()) / 10  # 588 kB raw


def test_a_format_1_checkpoint_with_raw_images_still_loads(tmp_path):
    from safetensors.torch import save_file

    images = [_image("RGB"), _image("RGB", (28, 56))]
    write_carried(tmp_path, [_group(images[:1], images[1:])], {})
    saved = json.loads((tmp_path / CARRIED_JSON).read_text())
    saved["format"] = 1  # what vlmrl wrote before PNG: no "encoding" key, raw bytes
    group = saved["groups"][0]
    for item in group["request"]["images"] + group["trajectories"][0]["tool_images"]:
        del item["encoding"]
    save_file({"g0/request/0": torch.frombuffer(bytearray(images[0].tobytes()), dtype=torch.uint8),
               "g0/t0/0": torch.frombuffer(bytearray(images[1].tobytes()), dtype=torch.uint8)},
              tmp_path / CARRIED_TENSORS)
    (tmp_path / CARRIED_JSON).write_text(json.dumps(saved))
    [(request, [traj])], _ = read_carried(tmp_path)
    assert request.images[0].tobytes() == images[0].tobytes()
    assert traj.tool_images[0].tobytes() == images[1].tobytes()


def test_a_damaged_image_is_refused_naming_the_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    write_carried(tmp_path, [_group([_image("RGB")], [])], {})
    tensors = load_file(tmp_path / CARRIED_TENSORS)
    raw = tensors["g0/request/0"].clone()
    raw[-20:] ^= 0xFF  # inside the PNG's last data chunk / checksum
    save_file({"g0/request/0": raw}, tmp_path / CARRIED_TENSORS)
    with pytest.raises(ValueError, match=r"agent_carried.json: image 'g0/request/0' .*a damaged checkpoint"):
        read_carried(tmp_path)
