"""The processor settings a run's data section implies (its image and prompt-length keys are `data.*`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlmrl.processors.config import ProcessorConfig

if TYPE_CHECKING:
    from vlmrl.config import DataConfig


def processor_config(data: DataConfig) -> ProcessorConfig:
    """The ProcessorConfig of a run: `load_processor(model_path, processor_config(config.data))`."""
    return ProcessorConfig(min_pixels=data.min_pixels, max_pixels=data.max_pixels,
                           max_prompt_length=data.max_prompt_length,
                           on_overlong="filter" if data.filter_overlong_prompts else "error",
                           on_bad_image=data.on_bad_image, data_root=data.data_root,
                           allow_remote_images=data.allow_remote_images, remote_timeout_s=data.remote_timeout_s,
                           remote_max_bytes=data.remote_max_bytes, max_image_pixels=data.max_image_pixels)
