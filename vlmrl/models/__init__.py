"""Model helpers: model families (`families`: every family's facts in one place), the embedded tiny models and
model-path resolution (`tiny`: `tiny`, `tiny-qwen3-vl` -> a locally built folder)."""
