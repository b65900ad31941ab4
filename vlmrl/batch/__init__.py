"""The VLM batch layout: per-sample padding, stacking, padding rows for divisibility, metrics without padding rows."""

from vlmrl.batch.padding import (
    PromptInputs,
    batch_metrics,
    pad_results,
    pad_sample,
    prompt_inputs,
    required_batch_multiple,
    scored_batch,
    stack_samples,
    upsample_to_multiple,
)

__all__ = [
    "PromptInputs",
    "batch_metrics",
    "pad_results",
    "pad_sample",
    "prompt_inputs",
    "required_batch_multiple",
    "scored_batch",
    "stack_samples",
    "upsample_to_multiple",
]
