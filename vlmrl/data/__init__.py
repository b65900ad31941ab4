"""Prompt data: verl/EasyR1-schema parquet datasets, their resumable batch order, and the embedded visual tasks."""

from importlib import import_module

# Imported on first use: the run config reads this package's config module and must not import torch.
_LAZY = {
    "BatchSampler": "dataset",
    "DataError": "dataset",
    "PromptQueue": "dataset",
    "RequestBatch": "dataset",
    "RLDataset": "dataset",
    "build_requests": "dataset",
    "load_dataset": "dataset",
    "resolve_files": "dataset",
    "sequential_batches": "dataset",
    "TASKS": "synthetic",
    "write_synthetic": "synthetic",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"vlmrl.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'vlmrl.data' has no attribute {name!r}")


__all__ = sorted(_LAZY)
