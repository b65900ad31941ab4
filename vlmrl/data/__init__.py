"""Prompt data: verl/EasyR1-schema parquet datasets, their resumable batch order, and the embedded visual tasks."""

from vlmrl.data.dataset import (
    BatchSampler,
    DataError,
    PromptQueue,
    RequestBatch,
    RLDataset,
    build_requests,
    load_dataset,
    resolve_files,
    sequential_batches,
)
from vlmrl.data.synthetic import TASKS, write_synthetic

__all__ = [
    "TASKS",
    "BatchSampler",
    "PromptQueue",


    "DataError",
    "RLDataset",
    "RequestBatch",
    "build_requests",
    "load_dataset",
    "resolve_files",
    "sequential_batches",
    "write_synthetic",
]
