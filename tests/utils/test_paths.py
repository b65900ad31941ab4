"""The cache folder: $VLMRL_CACHE when set, else ~/.cache/vlmrl; models and synthetic data both live under it."""

from __future__ import annotations

from pathlib import Path

from vlmrl.data.dataset import cache_dir
from vlmrl.utils.paths import cache_root


def test_cache_root_follows_vlmrl_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path))
    assert cache_root() == tmp_path and cache_dir() == tmp_path / "data"
    monkeypatch.delenv("VLMRL_CACHE")
    assert cache_root() == Path.home() / ".cache" / "vlmrl"
