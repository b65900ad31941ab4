"""mrope position ids with videos: equal to the rollout engines' own computation (vLLM's
`Qwen2_5_VLForConditionalGeneration.get_mrope_input_positions`, SGLang's `get_rope_index`) on generated batches
mixing videos, images and text, with left, right and no padding, long videos included (the text after a video
continues at its largest position + 1); and equal to transformers' Qwen2.5-VL get_rope_index wherever its rule (the
text continues at start + max(h, w)) is the same, i.e. no video's last temporal position reaches max(h, w)."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.processors.helpers import first_difference
from vlmrl.processors.loading import load_processor
from vlmrl.processors.rope import mrope_position_ids

NUM_GENERATED_CASES = 40
PADDINGS = ("left", "right", "none", "left")
SECONDS = (1.0, 0.5, 2 / 24, 0.75, 1 / 3, 2.0)  # 2, 4, 24, 8/3, 6 and 1 sampled fps
PATTERNS = (["video"], ["image", "video"], ["video", "image"], ["video", "video"], ["image", "video", "image"])


@pytest.fixture(scope="module")
def processor(tiny_model_path):
    return load_processor(tiny_model_path)


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_path).eval()


@pytest.fixture(scope="module")
def hf_config(tiny_model_path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model_path)


# ---------------------------------------------------------------------------------------------------- references


def hf_rope_index(hf_model, processor, input_ids, mask, image_grid, video_grid, seconds):
    """transformers' get_rope_index fed as its processor feeds it: mm_token_type_ids 1 on image, 2 on video tokens."""
    types = ((input_ids == processor.image_token_id).to(torch.int32)
             + 2 * (input_ids == processor.video_token_id).to(torch.int32))
    positions, _ = hf_model.model.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=image_grid,
                                                 video_grid_thw=video_grid, second_per_grid_ts=seconds,
                                                 attention_mask=mask)
    return positions


def vllm_positions(hf_config, processor, ids: list[int], images, videos, seconds) -> torch.Tensor:
    """(3, L) positions of one unpadded prompt by vLLM's own Qwen2.5-VL code, given its items as the engine holds
    them (a feature per image / video at its placeholder offset, second_per_grid_ts a float32 tensor)."""
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as VllmQwen
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        MultiModalSharedField,
        PlaceholderRange,
    )

    def elem(value):
        return MultiModalFieldElem(data=value, field=MultiModalSharedField(batch_size=1))

    features, items = [], iter([("image", g, None) for g in images])
    video_items = iter([("video", g, s) for g, s in zip(videos, seconds)])
    for offset in _run_starts(ids, {processor.image_token_id, processor.video_token_id}):
        kind, grid, secs = next(items) if ids[offset] == processor.image_token_id else next(video_items)
        data = {f"{kind}_grid_thw": elem(torch.tensor(grid))}
        if secs is not None:
            data["second_per_grid_ts"] = elem(torch.tensor(secs, dtype=torch.float32))
        length = int(np.prod(grid)) // processor.spatial_merge_size**2
        features.append(MultiModalFeatureSpec(data=MultiModalKwargsItem(data), modality=kind,
                                              identifier=f"{kind}{offset}",
                                              mm_position=PlaceholderRange(offset=offset, length=length)))
    model = SimpleNamespace(config=hf_config)
    model.iter_mm_grid_thw = lambda feats: VllmQwen.iter_mm_grid_thw(model, feats)
    positions, _ = VllmQwen.get_mrope_input_positions(model, ids, features)
    return positions


def sglang_positions(hf_config, processor, ids: list[int], images, videos, seconds) -> torch.Tensor:
    """(3, L) positions of one unpadded prompt by SGLang's own get_rope_index (its Qwen2.5-VL branch)."""
    from vlmrl.rollout.sglang import cpu_env

    # SGLang reads its CPU switch once, at import, for this whole process (engine tests run in it later): set it
    # first, as the sglang backend does
    os.environ.update(cpu_env())
    from sglang.srt.layers.rotary_embedding.mrope_rope_index import get_rope_index

    vision_start = processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    positions, _ = get_rope_index(
        hf_config.vision_config.spatial_merge_size, processor.image_token_id, processor.video_token_id, vision_start,
        "qwen2_5_vl", hf_config.vision_config.tokens_per_second, torch.tensor([ids]),
        torch.tensor(images) if images else None, torch.tensor(videos) if videos else None,
        torch.tensor(seconds, dtype=torch.float32) if seconds else None)
    return positions[:, 0]


def _run_starts(ids: list[int], tokens: set[int]) -> list[int]:
    return [i for i, t in enumerate(ids) if t in tokens and (i == 0 or ids[i - 1] != t)]


# ---------------------------------------------------------------------------------------------------- cases


def _row(rng: random.Random, processor, items: list[str]):
    """Expanded ids of one prompt holding the given vision items ("image"/"video") between random text; videos
    of up to 12 temporal patches, so about half reach past max(h, w)."""
    vision_start, vision_end = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])

    def text(lo: int) -> list[int]:
        return [rng.randrange(20, 700) for _ in range(rng.randint(lo, 5))]

    ids, images, videos, seconds = text(0), [], [], []
    for kind in items:
        h, w = 2 * rng.randint(1, 5), 2 * rng.randint(1, 5)
        if kind == "video":
            t = rng.randint(1, 12)
            videos.append([t, h, w])
            seconds.append(rng.choice(SECONDS))
            token = processor.video_token_id
        else:
            t = 1
            images.append([t, h, w])
            token = processor.image_token_id
        ids += [vision_start] + [token] * (t * h * w // 4) + [vision_end] + text(0)
    return ids + text(1), images, videos, seconds


def _case(case: int, processor):
    """Rows of generated case `case` and its padding: row 0 holds the case's pattern, further rows (padded cases)
    text only, images, videos, or both."""
    rng = random.Random(1000 + case)
    padding = PADDINGS[case % 4]
    rows = [_row(rng, processor, PATTERNS[case % len(PATTERNS)])]
    if padding != "none":
        rows += [_row(rng, processor, rng.choice([[], ["image"], ["video"], ["image", "video"]]))
                 for _ in range(rng.randint(1, 3))]
    return rows, padding


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


def _is_long(grid: list[int], seconds: float, tokens_per_second: float) -> bool:
    """Whether the video's last temporal position reaches max(h, w) (merged): where transformers 5.19 differs."""
    t, h, w = grid
    last = int(np.float32(t - 1) * np.float32(seconds) * np.float32(tokens_per_second))
    return last >= max(h, w) // 2


def _per_row(processor, rows, padding, reference):
    """vlmrl's ids of the padded batch against `reference` on each row alone, unpadded."""
    input_ids, mask, image_grid, video_grid, seconds = _batch(rows, padding, processor.pad_token_id)
    ours = processor.position_ids(input_ids, mask, image_grid, video_grid, seconds)
    for i, (ids, images, videos, secs) in enumerate(rows):
        attended = torch.ones(input_ids.shape[1], dtype=torch.bool) if mask is None else mask[i].bool()
        expected = reference(ids, images, videos, secs).to(torch.long)
        got = ours[:, i, attended]
        assert torch.equal(expected, got), f"row {i}: " + first_difference(expected[:, None], got[:, None])


# ---------------------------------------------------------------------------------------------------- tests


def test_the_generated_cases_hold_long_and_short_videos(processor):
    """Both kinds the engine comparisons below must cover: videos past the bound the old check refused (about half)
    and videos within it (the transformers comparison)."""
    videos = [(v, s) for case in range(NUM_GENERATED_CASES) for r in _case(case, processor)[0]
              for v, s in zip(r[2], r[3])]
    long = sum(_is_long(v, s, processor.video.tokens_per_second) for v, s in videos)
    assert long >= 20 and len(videos) - long >= 20, (long, len(videos))


@pytest.mark.vllm
@pytest.mark.parametrize("case", range(NUM_GENERATED_CASES))
def test_generated_video_batch_equals_vllm(case, processor, hf_config):
    rows, padding = _case(case, processor)
    _per_row(processor, rows, padding, lambda *row: vllm_positions(hf_config, processor, *row))


@pytest.mark.sglang
@pytest.mark.parametrize("case", range(NUM_GENERATED_CASES))
def test_generated_video_batch_equals_sglang(case, processor, hf_config):
    rows, padding = _case(case, processor)
    _per_row(processor, rows, padding, lambda *row: sglang_positions(hf_config, processor, *row))


@pytest.mark.parametrize("case", range(NUM_GENERATED_CASES))
def test_generated_video_batch_equals_transformers_where_its_rule_agrees(case, processor, hf_model):
    """transformers 5.19 agrees up to the end of the first long video; where no video is long, everywhere."""
    rows, padding = _case(case, processor)
    input_ids, mask, image_grid, video_grid, seconds = _batch(rows, padding, processor.pad_token_id)
    expected = hf_rope_index(hf_model, processor, input_ids, mask, image_grid, video_grid, seconds)
    actual = processor.position_ids(input_ids, mask, image_grid, video_grid, seconds)
    tps = processor.video.tokens_per_second
    for i, (ids, _, videos, secs) in enumerate(rows):
        long = [k for k, (v, s) in enumerate(zip(videos, secs)) if _is_long(v, s, tps)]
        columns = torch.arange(input_ids.shape[1]) if mask is None else mask[i].nonzero().squeeze(1)
        if long:  # compare up to the first long video's last token
            end = _run_starts(ids, {processor.video_token_id})[long[0]] + int(np.prod(videos[long[0]])) // 4
            columns = columns[:end]
        e, a = expected[:, i, columns], actual[:, i, columns]
        assert torch.equal(e, a), f"row {i}: " + first_difference(e[:, None], a[:, None])


def test_text_after_a_long_video_continues_at_its_last_position_plus_one():
    """3 temporal patches of 2x2 merged at 1 s each, 2 tokens per second: temporal ids 1, 3, 5, so the next token
    takes 6 (the engines' and Qwen's rule), not start + max(h, w) = 3 (transformers 5.19's). An image is unchanged:
    the next token after a 2x2 image at 7 takes 7 + 2."""
    ids = torch.tensor([[5] + [9] * 12 + [6] + [8] * 4 + [7]])
    positions = mrope_position_ids(ids, None, torch.tensor([[1, 4, 4]]), image_token_id=8, video_token_id=9,
                                   video_grid_thw=torch.tensor([[3, 4, 4]]), second_per_grid_ts=torch.tensor([1.0]),
                                   tokens_per_second=2)
    assert positions[0, 0, 1:13].tolist() == [1] * 4 + [3] * 4 + [5] * 4
    assert positions[:, 0, 13].tolist() == [6, 6, 6]
    assert positions[:, 0, 14:18].tolist() == [[7] * 4, [7, 7, 8, 8], [7, 8, 7, 8]]
    assert positions[:, 0, 18].tolist() == [9, 9, 9]


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


@pytest.mark.vllm
def test_vllm_floors_one_lower_where_float32_rounds_up(processor, hf_config):
    """A known engine difference (docs/engines.md, "Position ids"): 12 frames sampled from 25 at 1 fps are 0.48 fps,
    4.1666665 s per temporal patch in float32 (just below 25/6). Temporal index 3 x 2 tokens per second is 24.999999
    in exact arithmetic: float32 rounds it to 25 (vlmrl, SGLang, transformers: Qwen's original code), vLLM's float64
    keeps it below and floors to 24. vlmrl keeps the model's rule; vLLM differs on that one temporal patch."""
    seconds = float(np.float32(2 / (12 / 25 * 1.0)))
    ids = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>"] + ["<|video_pad|>"] * 24 + ["<|vision_end|>"])
    row = ([], [[6, 4, 4]], [seconds])
    ours = processor.position_ids(torch.tensor([ids]), None, None, torch.tensor(row[1]), torch.tensor(row[2]))[:, 0]
    assert torch.equal(ours, sglang_positions(hf_config, processor, ids, *row).long())
    theirs = vllm_positions(hf_config, processor, ids, *row)
    temporal = [int(ours[0, 1 + 4 * k]) - 1 for k in range(6)], [int(theirs[0, 1 + 4 * k]) - 1 for k in range(6)]
    assert temporal == ([0, 8, 16, 25, 33, 41], [0, 8, 16, 24, 33, 41])


def test_video_count_mismatch_is_an_error_naming_the_videos(processor):
    ids = torch.tensor([[1] + [processor.video_token_id] * 4 + [2]])
    with pytest.raises(ValueError, match="video_grid_thw has 0 videos but the ids hold 1 video runs"):
        processor.position_ids(ids, None, None)
