"""Processors: dataset rows -> one `RolloutRequest` for every backend; the trainer's image inputs and mrope ids."""

from vlmrl.processors.config import ProcessorConfig
from vlmrl.processors.errors import BadRowError, FilteredRow
from vlmrl.processors.from_data import processor_config
from vlmrl.processors.images import ImageInputError, image_hash
from vlmrl.processors.qwen_vl import Processor, load_processor
from vlmrl.processors.rope import mrope_position_ids

__all__ = [
    "BadRowError",
    "FilteredRow",
    "ImageInputError",
    "Processor",
    "ProcessorConfig",
    "image_hash",
    "load_processor",
    "mrope_position_ids",
    "processor_config",
]
