"""The VLM batch layout: per-sample padding, stacking, padding rows for divisibility, metrics without padding rows."""

from vlmrl.batch.padding import (
    batch_metrics,
    pad_results,
    pad_sample,
    required_batch_multiple,
    scored_batch,
    stack_samples,
    upsample_to_multiple,
)

__all__ = [
    "batch_metrics",
    "pad_results",
    "pad_sample",
    "required_batch_multiple",
    "scored_batch",
    "stack_samples",
    "upsample_to_multiple",
]
