"""Processors: dataset rows -> one `RolloutRequest` for every backend; the trainer's image inputs and mrope ids."""

from importlib import import_module

# Imported on first use: the run config reads this package's config module and must not import torch.
_LAZY = {
    "ProcessorConfig": "config",
    "BadRowError": "errors",
    "FilteredRow": "errors",
    "ImageInputError": "images",
    "image_hash": "images",
    "Processor": "qwen_vl",
    "load_processor": "qwen_vl",
    "mrope_position_ids": "rope",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"vlmrl.processors.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'vlmrl.processors' has no attribute {name!r}")


__all__ = sorted(_LAZY)
