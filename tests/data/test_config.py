"""The data section: its own keys plus the processor's, which it inherits (one declaration, one doc, one check)."""

from __future__ import annotations

import dataclasses

from vlmrl.config import describe, field_docs
from vlmrl.data.config import DataConfig
from vlmrl.processors.config import ProcessorConfig


def test_the_data_section_is_a_processor_config_with_the_same_keys():
    processor_keys = {f.name for f in dataclasses.fields(ProcessorConfig)}
    assert processor_keys <= {f.name for f in dataclasses.fields(DataConfig)}
    assert processor_keys == {"min_pixels", "max_pixels", "max_prompt_length", "filter_overlong_prompts",
                              "on_bad_image", "data_root", "allow_remote_images", "remote_timeout_s",
                              "remote_max_bytes", "max_image_pixels",
                              # frame sampling of videos (qwen-vl-utils' rules), done once by the processor
                              "video_fps", "video_nframes", "video_min_frames", "video_max_frames",
                              "video_min_pixels", "video_max_pixels", "video_total_pixels", "video_max_decoded_frames"}


def test_inherited_keys_are_documented_by_their_owner():
    rows = {key: doc for key, _, doc in describe(DataConfig, prefix="data.")}
    assert rows["data.min_pixels"] == field_docs(ProcessorConfig)["min_pixels"]
    assert "the model's image processor's bound" in rows["data.min_pixels"]
    keys = list(rows)
    assert keys.index("data.train_files") < keys.index("data.min_pixels")  # own keys first, then the processor's


def test_data_checks_include_the_processors():
    problems = DataConfig(train_batch_size=0, max_response_length=0, on_bad_image="skip").problems()
    assert problems[:2] == ["data.train_batch_size=0 must be >= 1", "data.max_response_length=0 must be >= 1"]
    assert problems[2:] == ProcessorConfig(on_bad_image="skip").problems()
    assert DataConfig().problems() == []
