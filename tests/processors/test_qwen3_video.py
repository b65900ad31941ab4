"""Qwen3-VL (and Qwen3.5, which takes video the same way) video: each temporal patch of 2 frames is `<x.x seconds><|vision_start|>` + its pads + `<|vision_end|>`
in the text, its grid is split per temporal patch for the position ids, and the frames fit the model's video
processor bounds (pixels of all frames together). vlmrl's expanded ids, pixel values, grids and position ids equal
transformers' Qwen3VLProcessor / get_rope_index on the same sampled frames."""

from __future__ import annotations

import random

import pytest
import torch

from tests.processors.helpers import first_difference
from vlmrl.data.config import DataConfig
from vlmrl.data.synthetic import generate_rows
from vlmrl.processors.errors import BadRowError
from vlmrl.processors.loading import load_processor
from vlmrl.processors.video import encode_mp4

NUM_GENERATED_CASES = 36
PADDINGS = ("left", "none", "right", "left")


@pytest.fixture(scope="module", params=["tiny-qwen3-vl", "tiny-qwen3.5"])
def tiny_qwen3_vl_path(request) -> str:
    """Each embedded family whose videos carry timestamps in the text, in turn (the module's name is Qwen3-VL's)."""
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built(request.param))


@pytest.fixture(scope="module")
def processor(tiny_qwen3_vl_path):
    return load_processor(tiny_qwen3_vl_path, DataConfig(max_prompt_length=2048))


@pytest.fixture(scope="module")
def hf_processor(tiny_qwen3_vl_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_qwen3_vl_path)


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_vl_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl_path).eval()


def _mp4_row(frames: int, fps: float, prompt: str = "<video>Which way?", size: int = 150) -> dict:
    gen = torch.Generator().manual_seed(frames)
    pixels = torch.randint(0, 256, (frames, size, size + 40, 3), generator=gen, dtype=torch.uint8).numpy()
    return {"prompt": [{"role": "user", "content": prompt}], "videos": [{"bytes": encode_mp4(pixels, fps)}]}


def _hf_inputs(hf_processor, processor, request):
    """What Qwen3VLProcessor makes of the request's rendered prompt and its (already sampled) frames."""
    text = processor.tokenizer.decode(request.prompt_ids)
    return hf_processor(text=[text], videos=[v.frames for v in request.videos], return_tensors="pt",
                        videos_kwargs={"do_sample_frames": False,
                                       "video_metadata": [v.metadata() for v in request.videos]})


@pytest.mark.parametrize(("row", "fps"), [
    (lambda: generate_rows("motion", 1, 0, "val")[0], 2.0),  # 4 frame images taken at data.video_fps
    (lambda: generate_rows("last_colour", 1, 1, "val")[0], 24.0),
    (lambda: _mp4_row(41, 25.0), 4.0),  # 1.64 s at 25 fps sampled at 4 fps: 6 frames, 3 temporal patches
])
def test_expanded_ids_pixels_and_positions_equal_transformers(processor, hf_processor, hf_model, tiny_qwen3_vl_path,
                                                              row, fps):
    """Frame lists at data.video_fps 2 and 24 and a clip sampled at 4 fps from 25 give the timestamps, pixels, grids
    and positions transformers gives; a clip sampled at 2 fps beside an image is the family matrix's
    (tests/families/test_family_matrix.py)."""
    processor = load_processor(tiny_qwen3_vl_path, DataConfig(max_prompt_length=2048, video_fps=fps))
    request = processor.build_request(row(), 0)
    inputs = processor.prompt_inputs(request)
    expected = _hf_inputs(hf_processor, processor, request)
    assert inputs.input_ids.tolist() == expected["input_ids"][0].tolist()
    mm = inputs.multi_modal_inputs
    assert torch.equal(mm["video_grid_thw"], expected["video_grid_thw"])
    assert torch.equal(mm["pixel_values_videos"], expected["pixel_values_videos"])
    assert "second_per_grid_ts" not in mm  # the timing is in the text
    positions, _ = hf_model.model.get_rope_index(expected["input_ids"], expected["mm_token_type_ids"], None,
                                                 expected["video_grid_thw"])
    assert torch.equal(inputs.position_ids, positions[:, 0]), first_difference(positions[:, 0], inputs.position_ids)
    # the length every backend checks is that of the expansion, timestamps included
    assert len(inputs.input_ids) == len(request.prompt_ids) - 1 + processor.video.token_count(request.videos[0])


def test_timestamps_are_the_temporal_patches_mean_times(processor):
    """6 frames sampled from a 10 fps clip at indices 0, 6, 12, 17, 23, 29: patches (0, 6), (12, 17), (23, 29)."""
    (video,) = processor.build_request(_mp4_row(30, 10.0), 0).videos
    assert video.frame_indices == [0, 6, 12, 17, 23, 29]
    assert processor.video.timestamps(video) == pytest.approx([0.3, 1.45, 2.6])
    text = processor.tokenizer.decode(processor.video.expansion(video))
    assert text.startswith("<0.3 seconds><|vision_start|><|video_pad|>") and "<|vision_end|><1.4 seconds>" in text


def test_frames_fit_the_models_per_video_bounds(processor):
    """The model's video processor bounds all frames' pixels together: more frames, smaller frames, so its own
    resize (which every engine runs) finds nothing to do."""
    low, high = processor.video.video_bounds
    for frames, fps in ((20, 10.0), (60, 10.0), (120, 10.0)):
        (video,) = processor.build_request(_mp4_row(frames, fps), 0).videos
        t, h, w = video.frames.shape[:3]
        assert low <= t * h * w <= high and h % 32 == 0 and w % 32 == 0


def test_too_many_frames_for_the_bounds_name_the_row(tiny_qwen3_vl_path):
    config = DataConfig(max_prompt_length=4096, video_min_pixels=32 * 32 * 160)  # x 6 frames > 786432
    processor = load_processor(tiny_qwen3_vl_path, config)
    with pytest.raises(BadRowError, match=r"row 4: video 0: video bytes: 6 frames cannot fit the model's video "
                                          r"processor bounds"):
        processor.build_request(_mp4_row(30, 10.0), 4)


def test_expanding_without_the_videos_is_an_error(processor):
    request = processor.build_request(generate_rows("motion", 1, 0, "val")[0], 0)
    grid = processor.multi_modal_inputs(request)["video_grid_thw"]
    with pytest.raises(ValueError, match=f"{processor.family.name} videos expand with their timestamps"):
        processor.expand_prompt_ids(request.prompt_ids, None, grid)


# ------------------------------------------------------------------ position ids on generated batches


def _row(rng: random.Random, processor, items: list[str]):
    """Expanded ids of one prompt holding the given vision items between random text, in Qwen3-VL's layout: a video
    is `<vs>` + per temporal patch (timestamp text, `<vs>`, pads, `<ve>`) + `<ve>`."""
    vs, ve = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])

    def text(lo: int) -> list[int]:
        return [rng.randrange(20, 700) for _ in range(rng.randint(lo, 5))]

    ids, images, videos = text(0), [], []
    for kind in items:
        h, w = 2 * rng.randint(1, 5), 2 * rng.randint(1, 5)
        if kind == "video":
            t = rng.randint(1, 5)
            videos.append([t, h, w])
            ids += [vs]
            for _ in range(t):
                ids += text(1) + [vs] + [processor.video_token_id] * (h * w // 4) + [ve]
            ids += [ve]
        else:
            images.append([1, h, w])
            ids += [vs] + [processor.image_token_id] * (h * w // 4) + [ve]
        ids += text(0)
    return ids + text(1), images, videos


@pytest.mark.parametrize("case", range(NUM_GENERATED_CASES))
def test_generated_video_batch_positions_equal_transformers(case, processor, hf_model):
    rng = random.Random(3000 + case)
    padding = PADDINGS[case % 4]
    patterns = [["video"], ["image", "video"], ["video", "image"], ["video", "video"], ["image", "video", "image"]]
    rows = [_row(rng, processor, patterns[case % len(patterns)])]
    if padding != "none":
        rows += [_row(rng, processor, rng.choice([[], ["image"], ["video"], ["image", "video"]]))
                 for _ in range(rng.randint(1, 3))]
    length = max(len(r[0]) for r in rows) + (0 if padding == "none" else 2)
    input_ids = torch.full((len(rows), length), processor.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, (ids, *_) in enumerate(rows):
        cols = slice(length - len(ids), length) if padding == "left" else slice(0, len(ids))
        input_ids[i, cols], mask[i, cols] = torch.tensor(ids), 1
    images = [g for r in rows for g in r[1]]
    videos = [g for r in rows for g in r[2]]
    image_grid = torch.tensor(images) if images else None
    video_grid = torch.tensor(videos) if videos else None
    mask = None if padding == "none" else mask
    types = ((input_ids == processor.image_token_id).to(torch.int32)
             + 2 * (input_ids == processor.video_token_id).to(torch.int32))
    expected, _ = hf_model.model.get_rope_index(input_ids, types, image_grid,
                                                None if video_grid is None else video_grid.clone(), mask)
    actual = processor.position_ids(input_ids, mask, image_grid, video_grid)
    assert torch.equal(expected, actual), first_difference(expected, actual)
