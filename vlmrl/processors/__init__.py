"""Processors: dataset rows -> one `RolloutRequest` for every backend; the trainer's image and video inputs and mrope
ids."""

from vlmrl.utils.lazy import lazy_exports

# Imported on first use (torch and transformers load with the processor).
_LAZY = {
    "BadRowError": "errors",
    "FilteredRow": "errors",
    "ImageInputError": "images",
    "image_hash": "images",
    "Processor": "qwen_vl",
    "load_processor": "qwen_vl",
    "mrope_position_ids": "rope",
    "VideoInputError": "video",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = sorted(_LAZY)
