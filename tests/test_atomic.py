"""Atomic writes: a crash while writing leaves the user's previous file whole and no temporary file behind."""

from __future__ import annotations

import pytest

from vlmrl.atomic import replace_atomically, write_text_atomically


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = write_text_atomically(tmp_path / "sub" / "metrics.jsonl", "old\n")  # the folder is created

    def crash(tmp: str) -> None:
        with open(tmp, "w") as handle:
            handle.write("half of the new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_atomically(path, crash)
    assert path.read_text() == "old\n"
    assert [p.name for p in path.parent.iterdir()] == ["metrics.jsonl"]
    write_text_atomically(path, "new\n")
    assert path.read_text() == "new\n" and len(list(path.parent.iterdir())) == 1


def test_written_files_get_the_usual_permissions_not_0600(tmp_path):
    """A validation artifact or a checkpoint file is shared and compared elsewhere: it must be readable like any file
    the user's umask lets them write (mkstemp alone leaves 0600)."""
    import os

    old = os.umask(0o022)
    try:
        path = write_text_atomically(tmp_path / "artifact.jsonl", "{}\n")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
