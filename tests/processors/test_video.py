"""Video rows -> requests: frames sampled once by qwen-vl-utils' rules and resized once, the same data-root rules as
images, and every bad video a clear error naming the row (or a counted skip with on_bad_image=filter)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from vlmrl.data.config import DataConfig
from vlmrl.data.synthetic import generate_rows
from vlmrl.processors.errors import BadRowError, FilteredRow
from vlmrl.processors.loading import load_processor
from vlmrl.processors.video import encode_mp4


def _processor(tiny_model_path, **kwargs):
    return load_processor(tiny_model_path, DataConfig(max_prompt_length=2048, **kwargs))


def _mp4(frames: int, fps: float = 10.0, size: int = 224) -> bytes:
    rng = np.random.default_rng(frames)
    return encode_mp4(rng.integers(0, 256, size=(frames, size, size, 3), dtype=np.uint8), fps)


def _row(video, prompt: str = "<video>Which way?") -> dict:
    return {"prompt": [{"role": "user", "content": prompt}], "videos": [video], "reward_model": {"ground_truth": "x"}}


def test_an_mp4_is_sampled_at_video_fps(tiny_model_path):
    """20 frames at 10 fps (2 s) sampled at 2 fps: 4 frames spread over the whole clip, resized within the tiny
    model's per-frame bound (112x112), one <|video_pad|>."""
    processor = _processor(tiny_model_path)
    request = processor.build_request(_row({"bytes": _mp4(20)}), 0)
    (video,) = request.videos
    assert video.frames.shape == (4, 112, 112, 3) and video.frames.dtype == np.uint8
    assert video.frame_indices == [0, 6, 13, 19] and video.fps == 10.0
    assert video.sample_fps == pytest.approx(2.0) and request.prompt_ids.count(processor.video_token_id) == 1


def test_nframes_and_content_parts(tiny_model_path, tmp_path):
    (tmp_path / "clip.mp4").write_bytes(_mp4(30))
    processor = _processor(tiny_model_path, video_nframes=4, data_root=str(tmp_path))
    row = {"prompt": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"},
                                                    {"type": "text", "text": "Which way?"}]}]}
    (video,) = processor.build_request(row, 0).videos
    assert video.num_frames == 4 and video.frame_indices == [0, 10, 19, 29]


def test_a_list_of_frames_is_a_video_at_video_fps(tiny_model_path):
    row = generate_rows("motion", 1, 0, "val")[0]
    (video,) = _processor(tiny_model_path, video_fps=4.0).build_request(row, 0).videos
    assert video.num_frames == 4 and video.sample_fps == 4.0 and video.timestamps == [0.0, 0.25, 0.5, 0.75]


@pytest.mark.parametrize(("video", "config", "message"), [
    ({"bytes": b"not a video at all"}, {}, "not a readable video"),
    ({"bytes": b""}, {}, "empty"),
    ({"path": "/nonexistent/clip.mp4"}, {}, "not found"),
    ({"bytes": _mp4(3)}, {}, "fewer than data.video_min_frames=4"),
    ({"bytes": _mp4(30)}, {"video_nframes": 20, "video_max_frames": 8}, "frame budget"),
    ({"bytes": _mp4(20)}, {"video_total_pixels": 3136}, "over the pixel budget"),
    ("../outside.mp4", {"data_root": "/tmp/vlmrl-video-root"}, "outside data_root"),
    ("https://example.com/v.mp4", {}, "allow_remote_images"),
])
def test_bad_videos_name_the_row(tiny_model_path, video, config, message):
    processor = _processor(tiny_model_path, **config)
    with pytest.raises(BadRowError, match=f"row 7: video 0: .*{message}"):
        processor.build_request(_row(video), 7)
    with pytest.raises(FilteredRow):
        _processor(tiny_model_path, on_bad_image="filter", **config).build_request(_row(video), 7)


def test_a_long_video_loads_and_the_text_after_it_follows_its_last_temporal_position(tiny_model_path):
    """6 s at 2 fps: 12 frames, 6 temporal patches of 4x4 merged, 1 s each at 2 tokens per second, so the last
    temporal position is start + 10, past max(h, w) = 4 (vlmrl refused such videos while it followed transformers
    5.19's rule). The text after it continues at start + 11, as the engines place it."""
    processor = _processor(tiny_model_path)
    inputs = processor.prompt_inputs(processor.build_request(_row({"bytes": _mp4(60)}), 7))
    assert inputs.multi_modal_inputs["video_grid_thw"].tolist() == [[6, 8, 8]]
    video = (inputs.input_ids == processor.video_token_id).nonzero().squeeze(1)
    first, last = int(video[0]), int(video[-1])
    start = int(inputs.position_ids[1, first])  # the height row starts at the video's start
    assert int(inputs.position_ids[0, last]) == start + 10
    assert inputs.position_ids[:, last + 1].tolist() == [start + 11] * 3


def test_marker_count_must_match_the_videos(tiny_model_path):
    processor = _processor(tiny_model_path)
    with pytest.raises(BadRowError, match="row 3: 2 video placeholders in the prompt but 1 videos"):
        processor.build_request(_row({"bytes": _mp4(20)}, "<video><video>Which way?"), 3)


def test_trainer_inputs_of_a_video_request(tiny_model_path):
    processor = _processor(tiny_model_path)
    request = processor.build_request(generate_rows("motion", 1, 0, "val")[0], 0)
    inputs = processor.prompt_inputs(request)
    mm = inputs.multi_modal_inputs
    assert mm["video_grid_thw"].tolist() == [[2, 8, 8]] and mm["second_per_grid_ts"].tolist() == [1.0]
    assert mm["pixel_values_videos"].shape == (2 * 8 * 8, 3 * 2 * 14 * 14)
    assert int((inputs.input_ids == processor.video_token_id).sum()) == 32
    assert processor.video_token_id in request.banned_token_ids


def test_a_qwen2_vl_checkpoint_refuses_video_by_row(tiny_model_path, tmp_path):
    """Qwen2-VL (model_type qwen2_vl) numbers a video's temporal positions one per temporal patch, not by
    tokens_per_second x seconds as Qwen2.5-VL does; vlmrl computes the latter, so such a row is refused, not
    trained on wrong position ids. Images still work."""
    import json
    import shutil

    folder = tmp_path / "qwen2-vl"
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "qwen2_vl"
    (folder / "config.json").write_text(json.dumps(config))
    processor = _processor(str(folder))
    with pytest.raises(BadRowError, match="row 3: video 0: .*model_type 'qwen2_vl'"):
        processor.build_request(_row({"bytes": _mp4(20)}), 3)
    assert _processor(tiny_model_path).build_request(_row({"bytes": _mp4(20)}), 3).videos
    image_row = generate_rows("colour", 1, 0, "val")[0]
    assert processor.build_request(image_row, 0).images


def _wav(seconds: float = 0.2) -> bytes:
    """A valid media file with an audio stream and no video stream."""
    import io
    import wave

    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(8000)
        out.writeframes(b"\0\0" * int(8000 * seconds))
    return buffer.getvalue()


def test_a_decode_error_says_its_cause_once(tiny_model_path, tmp_path):
    """The decode budget and a missing video stream are the cause, not a symptom of an unreadable file."""
    (tmp_path / "long.mp4").write_bytes(_mp4(12))
    (tmp_path / "sound.wav").write_bytes(_wav())
    processor = _processor(tiny_model_path, data_root=str(tmp_path), video_max_decoded_frames=10)
    with pytest.raises(BadRowError) as info:
        processor.build_request(_row("long.mp4"), 7)
    assert str(info.value) == (f"row 7: video 0: video file {tmp_path / 'long.mp4'} has over "
                               "data.video_max_decoded_frames=10 frames (the decode budget)")
    with pytest.raises(BadRowError) as info:
        processor.build_request(_row("sound.wav"), 7)
    assert str(info.value) == f"row 7: video 0: video file {tmp_path / 'sound.wav'} holds no video stream"


@pytest.mark.parametrize(("bad", "config", "message"), [
    (3, {}, "video file {path} has 3 frames, fewer than data.video_min_frames=4"),
    # 2 s sample 4 frames, which fit 6272 pixels at 3136 per frame; 6 s sample 12, which do not
    (60, {"video_total_pixels": 6272}, ("video file {path}: 12 frames cannot fit data.video_total_pixels=6272 .*over "
                                        "the pixel budget")),
])
def test_of_a_rows_videos_the_error_names_the_bad_ones_file(tiny_model_path, tmp_path, bad, config, message):
    (tmp_path / "fine.mp4").write_bytes(_mp4(20))
    (tmp_path / "bad.mp4").write_bytes(_mp4(bad))
    processor = _processor(tiny_model_path, data_root=str(tmp_path), **config)
    row = {"prompt": [{"role": "user", "content": "<video><video>Which way?"}], "videos": ["fine.mp4", "bad.mp4"]}
    expected = message.format(path=re.escape(str(tmp_path / "bad.mp4")))
    with pytest.raises(BadRowError, match=f"^row 7: video 1: {expected}"):
        processor.build_request(row, 7)


def test_video_bytes_with_a_path_are_named_by_it(tiny_model_path):
    with pytest.raises(BadRowError, match=r"row 7: video 0: video bytes \(clips/short.mp4\) has 3 frames"):
        _processor(tiny_model_path).build_request(_row({"bytes": _mp4(3), "path": "clips/short.mp4"}), 7)


@pytest.mark.parametrize("module", ["vlmrl.processors.images", "vlmrl.processors.video", "vlmrl.processors.bounds"])
def test_doctests(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
