"""The VLM batch layout (`padding`): per-sample padding, stacking, padding rows for divisibility, metrics without
padding rows."""
