"""Checkpoints: complete HF model folders, atomic visibility, newest-complete discovery, keep-last-K, state round trip."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from vlmrl.trainer.checkpoint import (
    checkpoints_root,
    latest_checkpoint,
    load_checkpoint_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32)


def _save(tmp_path, model, tiny_model_path, step, keep=None, state=None):
    return save_checkpoint(tmp_path, step, model, tiny_model_path, trainer_state=state or {"x": torch.ones(2)},
                           info={"data": {"epoch": 0, "offset": step}}, keep=keep)


def test_checkpoint_is_a_complete_model_folder(tmp_path, model, tiny_model_path):
    from transformers import AutoModelForImageTextToText

    from vlmrl.processors import load_processor

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
    (root / "latest").write_text("global_step_9\n")  # pointer to something that is not there
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
