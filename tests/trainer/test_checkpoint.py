"""Checkpoints: complete HF model folders, atomic visibility, newest-complete discovery, keep-last-K, state round trip."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vlmrl.trainer.checkpoint import (
    checkpoints_root,
    latest_checkpoint,
    load_checkpoint_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
    tidy_checkpoints,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32)


def _save(tmp_path, model, tiny_model_path, step, keep=None, state=None):
    return save_checkpoint(tmp_path, step, model, tiny_model_path, trainer_state=state or {"x": torch.ones(2)},
                           info={"data": {"epoch": 0, "offset": step}}, keep=keep)


def test_checkpoint_is_a_complete_model_folder(tmp_path, model, tiny_model_path):
    from transformers import AutoModelForImageTextToText

    from vlmrl.processors.loading import load_processor

    path = _save(tmp_path, model, tiny_model_path, 3)
    reloaded = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name
    processor = load_processor(str(path))  # tokenizer, chat template and image processor came along
    assert processor.tokenizer.chat_template == load_processor(tiny_model_path).tokenizer.chat_template


def test_state_round_trip_and_latest(tmp_path, model, tiny_model_path):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    _save(tmp_path, model, tiny_model_path, 1)
    path = _save(tmp_path, model, tiny_model_path, 2, state={"optimizer": optimizer.state_dict(), "rng": rng_state()})
    expected = (random.random(), torch.rand(3))
    assert latest_checkpoint(tmp_path) == path
    state, info = load_checkpoint_state(path)  # weights_only=True: no pickle
    assert info["step"] == 2 and info["data"]["offset"] == 2
    set_rng_state(state["rng"])
    got = (random.random(), torch.rand(3))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(state["optimizer"])
    saved = optimizer.state_dict()["state"]
    assert saved, "the optimizer had state to save"
    for key, value in saved.items():
        assert torch.equal(fresh.state_dict()["state"][key]["exp_avg"], value["exp_avg"])


def test_half_written_checkpoints_are_never_picked_up(tmp_path, model, tiny_model_path):
    good = _save(tmp_path, model, tiny_model_path, 4)
    root = checkpoints_root(tmp_path)
    # a run killed mid-save leaves a .tmp folder; a folder without its state files is incomplete
    shutil.copytree(good, root / ".tmp-global_step_6-abc")
    incomplete = root / "global_step_5"
    shutil.copytree(good, incomplete)
    (incomplete / "trainer_state.pt").unlink()
    assert latest_checkpoint(tmp_path) == good
    (root / "latest").unlink()
    (root / "latest").symlink_to("global_step_9")  # a link to something that is not there
    assert latest_checkpoint(tmp_path) == good
    _save(tmp_path, model, tiny_model_path, 7)
    assert not (root / ".tmp-global_step_6-abc").exists(), "leftovers are cleaned by the next save"


def test_keeps_only_the_newest_k(tmp_path, model, tiny_model_path):
    for step in (2, 4, 6, 8):
        _save(tmp_path, model, tiny_model_path, step, keep=2)
    names = sorted(p.name for p in checkpoints_root(tmp_path).iterdir() if p.name.startswith("global_step"))
    assert names == ["global_step_6", "global_step_8"]
    assert latest_checkpoint(tmp_path).name == "global_step_8"


def test_saving_the_same_step_again_replaces_it(tmp_path, model, tiny_model_path):
    _save(tmp_path, model, tiny_model_path, 2, state={"x": torch.zeros(1)})
    path = _save(tmp_path, model, tiny_model_path, 2, state={"x": torch.ones(1)})
    state, _ = load_checkpoint_state(path)
    assert torch.equal(state["x"], torch.ones(1))


def test_no_checkpoint_means_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None


# ------------------------------------------------------------- kills at each point of a save, with light stand-ins
# A stand-in model (what save_pretrained writes, no weights to load) keeps these fast enough to run many saves.


class _Weights:
    config = {"model_type": "qwen2_5_vl"}  # a dense family: saved exactly as its save_pretrained writes it

    def save_pretrained(self, folder, safe_serialization=True):
        Path(folder, "config.json").write_text("{}")
        Path(folder, "model.safetensors").write_bytes(b"w" * 4096)


def _light_save(out, step, keep=2):
    source = Path(out) / "source_model"
    source.mkdir(parents=True, exist_ok=True)
    (source / "tokenizer.json").write_text("{}")
    return save_checkpoint(out, step, _Weights(), str(source), trainer_state={"x": torch.ones(1)},
                           info={"data": {"offset": step}}, keep=keep)


def _names(out):
    return sorted(p.name for p in checkpoints_root(out).iterdir())


# Runs checkpoint saves 1..5 (keep 2) in a subprocess that SIGKILLs itself at one exact point: `kill_when` is an
# expression over `calls` (how often the patched function ran), checked each time the patched function runs.
_SAVE_LOOP = textwrap.dedent("""
    import os, shutil, signal, sys
    sys.path.insert(0, {root!r})
    from tests.trainer.test_checkpoint import _light_save
    import vlmrl.trainer.checkpoint as ckpt
    calls = 0
    real = {real}
    def patched(*args, **kwargs):
        global calls
        calls += 1
        if {kill_when}:
            {before_kill}
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    {patch} = patched
    for step in range(1, 6):
        _light_save({out!r}, step)
""")


def _save_loop_killed(out, real, patch, kill_when, before_kill="pass"):
    script = _SAVE_LOOP.format(root=str(ROOT), out=str(out), real=real, patch=patch, kill_when=kill_when,
                               before_kill=before_kill)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]


def test_kill_9_between_the_rename_and_the_pointer_resumes_from_the_new_checkpoint(tmp_path):
    # the third rewrite of `latest` never happens: global_step_3 is in place, the link still names global_step_2
    _save_loop_killed(tmp_path, "ckpt._point_latest", "ckpt._point_latest", "calls == 3")
    root = checkpoints_root(tmp_path)
    assert os.readlink(root / "latest") == "global_step_2"
    assert (root / "global_step_3").is_dir()
    assert latest_checkpoint(tmp_path) == root / "global_step_3"
    tidy_checkpoints(tmp_path, keep=2)  # the next start points the link at the newest again
    assert os.readlink(root / "latest") == "global_step_3"


def test_the_start_says_once_where_latest_pointed_and_why_it_moves(tmp_path, caplog):
    _save_loop_killed(tmp_path, "ckpt._point_latest", "ckpt._point_latest", "calls == 3")
    root = checkpoints_root(tmp_path)
    with caplog.at_level(logging.INFO, logger="vlmrl.trainer.checkpoint"):
        tidy_checkpoints(tmp_path, keep=2)
        tidy_checkpoints(tmp_path, keep=2)  # a second start finds the link right: nothing to say
    moved = [r.getMessage() for r in caplog.records if str(root / "latest") in r.getMessage()]
    assert moved == [(f"{root / 'latest'} named global_step_2; it names global_step_3 now, the newest complete "
                      "checkpoint (a run killed after saving global_step_3 and before re-pointing the link)")]
    # the folder it named is gone (deleted by hand): said as such
    caplog.clear()
    os.symlink("global_step_9", root / ".tmp-link")
    os.replace(root / ".tmp-link", root / "latest")
    with caplog.at_level(logging.INFO, logger="vlmrl.trainer.checkpoint"):
        tidy_checkpoints(tmp_path, keep=2)
    assert "named global_step_9; it names global_step_3 now" in caplog.text
    assert "the folder it named is gone" in caplog.text


def test_the_pointer_lagging_by_one_is_overruled_by_the_newest_complete_step(tmp_path):
    _light_save(tmp_path, 1)
    _light_save(tmp_path, 2)
    latest = checkpoints_root(tmp_path) / "latest"
    latest.unlink()
    latest.write_text("global_step_1\n")  # as an earlier version wrote it, after a kill before the rewrite
    assert latest_checkpoint(tmp_path).name == "global_step_2"


def test_latest_is_a_model_path_like_any_other(tmp_path):
    _light_save(tmp_path, 1)
    _light_save(tmp_path, 2)
    latest = checkpoints_root(tmp_path) / "latest"
    assert latest.is_dir() and os.readlink(latest) == "global_step_2"  # relative: the output folder can move
    assert (latest / "config.json").exists() and load_checkpoint_state(latest)[1]["step"] == 2


def test_a_copy_that_followed_the_latest_link_is_resumed_and_saved_into(tmp_path):
    """shutil.copytree (and rsync -L, object stores) turn `latest` into a real folder: the copy still resumes from its
    newest step, and the next save puts the link back instead of failing on the folder."""
    _light_save(tmp_path / "run", 1)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "run", copy)
    assert not (checkpoints_root(copy) / "latest").is_symlink()
    assert latest_checkpoint(copy).name == "global_step_1"
    _light_save(copy, 2)
    assert os.readlink(checkpoints_root(copy) / "latest") == "global_step_2"


def test_kill_9_in_the_middle_of_pruning_leaves_no_extra_checkpoint_after_the_next_start(tmp_path):
    # the first delete (of global_step_1, at the third save) removes the weights file, then the process dies
    _save_loop_killed(tmp_path, "shutil.rmtree", "shutil.rmtree", "calls == 1",
                      before_kill="os.remove(os.path.join(args[0], 'model.safetensors'))")
    root = checkpoints_root(tmp_path)
    assert not (root / "global_step_1" / "model.safetensors").exists(), "the kill came in the middle of the delete"
    tidy_checkpoints(tmp_path, keep=2)  # what a resuming run does first
    assert _names(tmp_path) == ["global_step_2", "global_step_3", "latest"]
    assert latest_checkpoint(tmp_path).name == "global_step_3"


def test_pruning_renames_aside_before_deleting(tmp_path):
    for step in (1, 2):
        _light_save(tmp_path, step)
    seen = []
    real = shutil.rmtree
    try:
        shutil.rmtree = lambda path, *a, **k: (seen.append(Path(path).name), real(path, *a, **k))
        _light_save(tmp_path, 3)
    finally:
        shutil.rmtree = real
    assert seen == [".deleting-global_step_1"]
    assert _names(tmp_path) == ["global_step_2", "global_step_3", "latest"]


def test_start_cleans_every_leftover_and_restores_a_step_moved_aside(tmp_path):
    for step in (1, 2, 3):
        _light_save(tmp_path, step, keep=None)
    root = checkpoints_root(tmp_path)
    # killed while saving step 3 again: the old step 3 moved aside, the new one still a temp folder
    os.rename(root / "global_step_3", root / ".tmp-stale-global_step_3-4242")
    (root / ".tmp-global_step_3-abcd").mkdir()
    # killed mid-delete (rename-aside) and mid-delete by an older version (a step folder missing its state)
    shutil.copytree(root / "global_step_1", root / ".deleting-global_step_0")
    (root / "global_step_1" / "trainer_state.pt").unlink()
    assert latest_checkpoint(tmp_path).name == "global_step_2"
    tidy_checkpoints(tmp_path, keep=2)
    assert _names(tmp_path) == ["global_step_2", "global_step_3", "latest"]
    assert load_checkpoint_state(root / "global_step_3")[1]["step"] == 3
