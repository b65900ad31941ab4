"""Atomic file writes: what vlmrl writes for the user (checkpoints, metrics, artifacts, reports, datasets) is either
the old file or the whole new one, never half of it, even after a crash."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def replace_atomically(path: str | os.PathLike, write: Callable[[str], Any]) -> Path:
    """`write(tmp)` fills a temporary file beside `path` (same folder, so the rename stays on one filesystem); it is
    synced to disk and renamed over `path`. On any failure the temporary file is removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; the user's files get the usual permissions
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """`text` (UTF-8) into `path`, atomically."""
    return replace_atomically(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _umask() -> int:
    """The process umask: from /proc on Linux; elsewhere by setting it and straight back (racy with other threads
    creating files at that instant, hence the /proc read first)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
