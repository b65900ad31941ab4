"""Model helpers: model families (`vlmrl.models.families`), the embedded tiny Qwen2.5-VL / Qwen3-VL and model-path
resolution (`tiny`, `tiny-qwen3-vl` -> a locally built folder)."""

from vlmrl.models.tiny import ensure_built, is_embedded, is_hub_id, resolve_model_path

__all__ = ["ensure_built", "is_embedded", "is_hub_id", "resolve_model_path"]
