"""The embedded visual tasks: deterministic, balanced, disjoint splits, and answers that only the image holds."""

from __future__ import annotations

import collections
import hashlib
import io

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from scipy import ndimage

from vlmrl.data.synthetic import COLOURS, TASKS, generate_rows, image_hashes, write_synthetic


def _pixels(row: dict) -> np.ndarray:
    """(H, W, 3) uint8 of a row's single image."""
    return np.asarray(Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB"))


def _foreground(pixels: np.ndarray) -> np.ndarray:
    """(H, W) bool: the shapes' pixels. The background is grey (R == G == B); no shape colour is ever grey."""
    return ~((pixels[..., 0] == pixels[..., 1]) & (pixels[..., 1] == pixels[..., 2]))


def test_same_seed_gives_identical_files_and_another_seed_does_not(tmp_path):
    first = write_synthetic(tmp_path / "a", "colour", n_train=24, n_val=8, seed=3)
    again = write_synthetic(tmp_path / "b", "colour", n_train=24, n_val=8, seed=3)
    other = write_synthetic(tmp_path / "c", "colour", n_train=24, n_val=8, seed=4)
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (*first, *again, *other)]
    assert digest[0:2] == digest[2:4], "the same seed must give byte-identical train and val files"
    assert digest[0] != digest[4] and digest[1] != digest[5], "another seed must give other data"


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_are_disjoint_balanced_and_the_text_carries_no_answer(tmp_path, task):
    train_path, val_path = write_synthetic(tmp_path, task, n_train=41, n_val=13, seed=0)
    train, val = pq.read_table(train_path).to_pylist(), pq.read_table(val_path).to_pylist()
    assert (len(train), len(val)) == (41, 13)
    assert not image_hashes(train) & image_hashes(val), "a validation image also appears in the train split"
    for rows in (train, val):
        counts = collections.Counter(row["reward_model"]["ground_truth"] for row in rows)
        assert set(counts) == set(TASKS[task].answers), counts
        assert max(counts.values()) - min(counts.values()) <= 1, f"answers are not evenly spread: {counts}"
    rows = train + val
    # One prompt for the whole task: the text cannot tell the answers apart.
    prompts = {row["prompt"][0]["content"] for row in rows}
    assert len(prompts) == 1, prompts
    assert prompts.pop().startswith("<video>" if TASKS[task].video else "<image>")
    assert {row["data_source"] for row in rows} == {f"synthetic/{task}"}
    assert [row["extra_info"]["index"] for row in train] == list(range(41))


def test_train_split_never_repeats_an_excluded_image():
    # Drawing the same stream again while excluding its own images forces every row to be redrawn.
    first = generate_rows("position", 30, seed=0, split="train")
    redrawn = generate_rows("position", 30, seed=0, split="train", exclude=image_hashes(first))
    assert not image_hashes(first) & image_hashes(redrawn)
    assert [r["reward_model"] for r in first] == [r["reward_model"] for r in redrawn], "labels must not change"


def test_colour_answer_is_the_colour_of_the_drawn_pixels():
    for row in generate_rows("colour", 40, seed=1, split="val"):
        pixels = _pixels(row)
        mean = pixels[_foreground(pixels)].reshape(-1, 3).mean(axis=0)
        nearest = min(COLOURS, key=lambda name: np.linalg.norm(mean - np.array(COLOURS[name])))
        assert nearest == row["reward_model"]["ground_truth"], row["extra_info"]


def test_position_answer_is_the_side_the_shape_is_on():
    for row in generate_rows("position", 40, seed=1, split="val"):
        columns = np.nonzero(_foreground(_pixels(row)).any(axis=0))[0]
        side = "left" if columns.max() < 28 else "right" if columns.min() >= 28 else "both"
        assert side == row["reward_model"]["ground_truth"]


def test_count_answer_is_the_number_of_separate_shapes():
    for row in generate_rows("count", 40, seed=1, split="val"):
        _, blobs = ndimage.label(_foreground(_pixels(row)))
        assert str(blobs) == row["reward_model"]["ground_truth"]


def test_shape_answer_matches_how_much_of_its_box_the_shape_fills():
    # A filled square covers its bounding box, a circle ~pi/4 of it, a triangle ~1/2.
    for row in generate_rows("shape", 40, seed=1, split="val"):
        mask = _foreground(_pixels(row))
        rows, cols = np.nonzero(mask)
        fill = mask.sum() / ((np.ptp(rows) + 1) * (np.ptp(cols) + 1))
        guess = "square" if fill > 0.93 else "circle" if fill > 0.65 else "triangle"
        assert guess == row["reward_model"]["ground_truth"], fill
