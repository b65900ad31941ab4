"""vlmrl's cache folder: built tiny models and generated synthetic data live under it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$VLMRL_CACHE, else ~/.cache/vlmrl."""
    return Path(os.environ.get("VLMRL_CACHE", Path.home() / ".cache" / "vlmrl"))
