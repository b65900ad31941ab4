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
