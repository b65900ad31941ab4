"""The alignment artifact and diff with videos: records carry each video's frame hashes, count, fps and grid, and a
one-sided change of the sampling rate is bucketed as an input mismatch (not as a model difference)."""

from __future__ import annotations

import dataclasses

from tests.alignment.toy_artifacts import make_side
from vlmrl.alignment.artifact import records_from_rollout
from vlmrl.alignment.causes import Cause
from vlmrl.alignment.diff import compare_artifacts
from vlmrl.data.config import DataConfig
from vlmrl.data.synthetic import generate_rows
from vlmrl.processors.loading import load_processor
from vlmrl.types import RolloutResult


def _records(tiny_model_path, fps: float):
    processor = load_processor(tiny_model_path, DataConfig(video_fps=fps))
    requests = [processor.build_request(row, i) for i, row in enumerate(generate_rows("motion", 2, 0, "val"))]
    results = [RolloutResult(r.uid, 0, [1, 2], [-0.5, -0.25], "length") for r in requests]
    return records_from_rollout(requests, results, [0.0] * len(requests), processor, thumbnails=False)


def test_records_carry_the_video_facts(tiny_model_path):
    (first, _), (fast, _) = _records(tiny_model_path, 2.0), _records(tiny_model_path, 24.0)
    video = first.videos[0]
    assert video["num_frames"] == 4 and video["fps"] == 2.0 and video["grid_thw"] == [2, 8, 8]
    assert len(set(video["frame_hashes"])) == 4, "the frames differ (the shape moves)"
    assert first.expanded_prompt_length == len(first.prompt_ids) - 1 + 2 * 8 * 8 // 4
    assert fast.videos[0]["frame_hashes"] == video["frame_hashes"] and fast.videos[0]["hash"] != video["hash"]


def test_a_one_sided_fps_change_is_an_input_mismatch(tiny_model_path):
    (slow, _), (fast, _) = _records(tiny_model_path, 2.0), _records(tiny_model_path, 24.0)
    meta_a, records_a = make_side(rows=10)
    meta_b, records_b = make_side(rows=10, backend="sglang")
    records_a = [dataclasses.replace(r, videos=slow.videos) for r in records_a]
    records_b = [dataclasses.replace(r, videos=fast.videos) for r in records_b]
    comparison = compare_artifacts(meta_a, records_a, meta_b, records_b)
    assert comparison.cause_counts == {Cause.INPUT_MISMATCH: 10}
    assert any("video 0 fps 2.0 vs 24.0" in d for d in comparison.samples[0].input_diffs)
    same = compare_artifacts(meta_a, records_a, meta_b, [dataclasses.replace(r, videos=slow.videos)
                                                         for r in records_b])
    assert same.cause_counts == {}
