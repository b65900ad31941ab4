"""Prompt data: verl/EasyR1-schema parquet datasets, their resumable batch order, and the embedded visual tasks."""

from vlmrl.utils.lazy import lazy_exports

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


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = sorted(_LAZY)
