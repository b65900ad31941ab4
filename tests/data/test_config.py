"""The data section: the datasets and lengths, and the image/video keys the processor is built from (one section,
each key declared and documented once)."""

from __future__ import annotations

import dataclasses

from vlmrl.config import describe, field_docs
from vlmrl.data.config import DataConfig


def test_the_data_section_holds_the_processors_keys():
    keys = {f.name for f in dataclasses.fields(DataConfig)}
    assert {"min_pixels", "max_pixels", "max_prompt_length", "filter_overlong_prompts", "on_bad_image", "data_root",
            "allow_remote_images", "remote_timeout_s", "remote_max_bytes", "max_image_pixels",
            # frame sampling of videos (qwen-vl-utils' rules), done once by the processor
            "video_fps", "video_nframes", "video_min_frames", "video_max_frames", "video_min_pixels",
            "video_max_pixels", "video_total_pixels", "video_max_decoded_frames"} < keys


def test_keys_are_documented_in_reading_order():
    rows = {key: doc for key, _, doc in describe(DataConfig, prefix="data.")}
    assert rows["data.min_pixels"] == field_docs(DataConfig)["min_pixels"]
    assert "the model's image processor's bound" in rows["data.min_pixels"]
    keys = list(rows)
    assert keys.index("data.train_files") < keys.index("data.min_pixels")  # datasets first, then image sizing


def test_data_checks_cover_the_image_keys():
    problems = DataConfig(train_batch_size=0, max_response_length=0, on_bad_image="skip").problems()
    assert problems == ["data.train_batch_size=0 must be >= 1", "data.max_response_length=0 must be >= 1",
                        "data.on_bad_image='skip' is not one of ['error', 'filter']"]
    assert DataConfig().problems() == []
