"""mrope position ids with videos: equal to transformers' Qwen2.5-VL get_rope_index on generated batches mixing
videos, images and text, with left, right and no padding (temporal positions spaced by tokens_per_second x
second_per_grid_t)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.processors.helpers import first_difference
from vlmrl.processors import load_processor, mrope_position_ids

NUM_GENERATED_CASES = 40
PADDINGS = ("left", "right", "none", "left")
SECONDS = (1.0, 0.5, 2 / 24, 0.75, 1 / 3, 2.0)  # 2, 4, 24, 8/3, 6 and 1 sampled fps


@pytest.fixture(scope="module")
def processor(tiny_model_path):
    return load_processor(tiny_model_path)


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_path).eval()


def hf_rope_index(hf_model, processor, input_ids, mask, image_grid, video_grid, seconds):
    """transformers' get_rope_index fed as its processor feeds it: mm_token_type_ids 1 on image, 2 on video tokens."""
    types = ((input_ids == processor.image_token_id).to(torch.int32)
             + 2 * (input_ids == processor.video_token_id).to(torch.int32))
    positions, _ = hf_model.model.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=image_grid,
                                                 video_grid_thw=video_grid, second_per_grid_ts=seconds,
                                                 attention_mask=mask)
    return positions


def _row(rng: random.Random, processor, items: list[str]):
    """Expanded ids of one prompt holding the given vision items ("image"/"video") between random text."""
    vision_start, vision_end = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])

    def text(lo: int) -> list[int]:
        return [rng.randrange(20, 700) for _ in range(rng.randint(lo, 5))]

    ids, images, videos, seconds = text(0), [], [], []
    for kind in items:
        h, w = 2 * rng.randint(1, 5), 2 * rng.randint(1, 5)
        if kind == "video":
            t = rng.randint(1, 6)
            videos.append([t, h, w])
            seconds.append(rng.choice(SECONDS))
            token = processor.video_token_id
        else:
            t = 1
            images.append([t, h, w])
            token = processor.image_token_id
        ids += [vision_start] + [token] * (t * h * w // 4) + [vision_end] + text(0)
    return ids + text(1), images, videos, seconds


def _batch(rows, padding: str, pad_id: int):
    length = max(len(r[0]) for r in rows) + (0 if padding == "none" else 2)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, (ids, *_) in enumerate(rows):
        sl = slice(length - len(ids), length) if padding == "left" else slice(0, len(ids))
        input_ids[i, sl] = torch.tensor(ids)
        mask[i, sl] = 1
    images = [g for r in rows for g in r[1]]
    videos = [g for r in rows for g in r[2]]
    seconds = [s for r in rows for s in r[3]]
    return (input_ids, None if padding == "none" else mask, torch.tensor(images) if images else None,
            torch.tensor(videos) if videos else None, torch.tensor(seconds) if seconds else None)


@pytest.mark.parametrize("case", range(NUM_GENERATED_CASES))
def test_generated_video_batch_equals_transformers(case, processor, hf_model):
    rng = random.Random(1000 + case)
    padding = PADDINGS[case % 4]
    patterns = [["video"], ["image", "video"], ["video", "image"], ["video", "video"], ["image", "video", "image"]]
    rows = [_row(rng, processor, patterns[case % len(patterns)])]
    if padding != "none":  # more rows: text only, images only, videos, mixed
        rows += [_row(rng, processor, rng.choice([[], ["image"], ["video"], ["image", "video"]]))
                 for _ in range(rng.randint(1, 3))]
    input_ids, mask, image_grid, video_grid, seconds = _batch(rows, padding, processor.pad_token_id)

    expected = hf_rope_index(hf_model, processor, input_ids, mask, image_grid, video_grid, seconds)
    actual = processor.position_ids(input_ids, mask, image_grid, video_grid, seconds)
    assert torch.equal(expected, actual), first_difference(expected, actual)


def test_temporal_positions_follow_the_sampled_fps():
    """One video of 3 temporal patches, 2x2 merged: at 2 fps (1 s per patch, 2 tokens per second) the temporal ids
    step by 2; at 24 fps they all stay at the start. Another fps is another input."""
    ids = torch.tensor([[5] + [9] * 12 + [6]])
    grid = torch.tensor([[3, 4, 4]])
    slow = mrope_position_ids(ids, None, None, image_token_id=8, video_token_id=9, video_grid_thw=grid,
                              second_per_grid_ts=torch.tensor([1.0]), tokens_per_second=2)
    fast = mrope_position_ids(ids, None, None, image_token_id=8, video_token_id=9, video_grid_thw=grid,
                              second_per_grid_ts=torch.tensor([2 / 24]), tokens_per_second=2)
    assert slow[0, 0, 1:13].tolist() == [1] * 4 + [3] * 4 + [5] * 4
    assert fast[0, 0, 1:13].tolist() == [1] * 12


def test_video_count_mismatch_is_an_error_naming_the_videos(processor):
    ids = torch.tensor([[1] + [processor.video_token_id] * 4 + [2]])
    with pytest.raises(ValueError, match="video_grid_thw has 0 videos but the ids hold 1 video runs"):
        processor.position_ids(ids, None, None)
