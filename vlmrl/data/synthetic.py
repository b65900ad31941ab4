"""The embedded visual tasks: small images drawn with PIL whose answer can only be read off the image.

Every row of a task carries the SAME question text, so the prompt says nothing about the answer; the answer words are
single tokens of the tiny model's tokenizer. Rows are balanced over the answers (counts differ by at most one) and
drawn from a seeded generator, so `write_synthetic(..., seed)` writes byte-identical parquet files on every run.
Shape kind, size, position and colour shade are jittered, so nothing but the pixels that matter predicts the answer.

Tasks (`data_source` is `synthetic/<task>`):
  - ``colour`` (the demo default): a 56x56 image, one square/circle/triangle in red, green, blue or yellow.
  - ``shape``: a 56x56 image, one shape of any of those colours; which shape is it (circle, square, triangle)?
  - ``position``: a 56x56 image, one shape wholly in the left or the right half; which side?
  - ``count``: a 112x112 image with 1-4 separated shapes of mixed kinds and colours; how many?
  - ``motion`` (video): 4 frames of 112x112 in which one shape moves steadily left or right; which way? No single
    frame tells (the start is anywhere along the path): the answer needs two frames or more. The row's `videos`
    column holds the frames as PNG images (a video given as a list of frames, taken at data.video_fps).
  - ``last_colour`` (video, the video demo): 4 frames of 112x112; one shape changes colour halfway (frames 0-1 one
    colour, frames 2-3 another); which colour is it at the end? Both colours are in the video, so the answer needs
    the frames' order (the temporal position ids), not one frame's pixels.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from vlmrl.atomic import replace_atomically

GENERATOR_VERSION = 1
"""Bump when the drawn images or the row layout change (it names the cache folder)."""

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 215, 20),
}
SHAPES = ("square", "circle", "triangle")
SHADE_JITTER = 25
"""Each colour channel moves by up to this much, so the task is colour naming, not matching four exact RGB values."""


@dataclass(frozen=True)
class Drawn:
    """One rendered example: the image and what is in it (the answer plus the facts a test can check)."""

    image: Image.Image | list[Image.Image]
    """The image, or a video task's frames."""
    answer: str
    details: dict[str, str]


@dataclass(frozen=True)
class SyntheticTask:
    name: str
    question: str
    """The same text for every row: the answer must come from the image."""
    answers: tuple[str, ...]
    image_size: int
    draw: Callable[[np.random.Generator, str], Drawn]
    """Renders an image (a video task: frames) whose true answer is the given one."""
    video: bool = False
    """The task's rows hold a video (`videos` column, `<video>` marker) instead of an image."""

    @property
    def data_source(self) -> str:
        return f"synthetic/{self.name}"


# ---------------------------------------------------------------------------------------------------- drawing


def _background(rng: np.random.Generator, size: int) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    grey = int(rng.integers(225, 256))
    image = Image.new("RGB", (size, size), (grey, grey, grey))
    return image, ImageDraw.Draw(image)


def _shade(rng: np.random.Generator, colour: str) -> tuple[int, int, int]:
    base = np.array(COLOURS[colour])
    jitter = rng.integers(-SHADE_JITTER, SHADE_JITTER + 1, size=3)
    return tuple(int(v) for v in np.clip(base + jitter, 0, 255))


def _shape(draw: ImageDraw.ImageDraw, kind: str, box: tuple[int, int, int, int], fill: tuple[int, int, int]) -> None:
    """Draws a filled shape inside the inclusive box (x0, y0, x1, y1); no anti-aliasing, so pixels stay pure."""
    x0, y0, x1, y1 = box
    if kind == "square":
        draw.rectangle(box, fill=fill)
    elif kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "triangle":
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)
    else:
        raise ValueError(f"unknown shape {kind!r}")


def _random_box(rng: np.random.Generator, size: int, lo: int, hi: int, x_range: tuple[int, int] | None = None):
    """A square box of side in [lo, hi] placed uniformly inside the image (or inside the x range [a, b))."""
    side = int(rng.integers(lo, hi + 1))
    x_lo, x_hi = x_range if x_range is not None else (0, size)
    x0 = int(rng.integers(x_lo, x_hi - side + 1))
    y0 = int(rng.integers(0, size - side + 1))
    return (x0, y0, x0 + side - 1, y0 + side - 1)


def _draw_colour(rng: np.random.Generator, answer: str) -> Drawn:
    image, draw = _background(rng, 56)
    kind = str(rng.choice(SHAPES))
    _shape(draw, kind, _random_box(rng, 56, 16, 32), _shade(rng, answer))
    return Drawn(image, answer, {"colour": answer, "shape": kind})


def _draw_shape(rng: np.random.Generator, answer: str) -> Drawn:
    image, draw = _background(rng, 56)
    colour = str(rng.choice(list(COLOURS)))
    _shape(draw, answer, _random_box(rng, 56, 18, 34), _shade(rng, colour))
    return Drawn(image, answer, {"colour": colour, "shape": answer})


def _draw_position(rng: np.random.Generator, answer: str) -> Drawn:
    image, draw = _background(rng, 56)
    colour, kind = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
    # A 4-pixel band around the middle stays empty, so the side is never ambiguous.
    x_range = (0, 26) if answer == "left" else (30, 56)
    _shape(draw, kind, _random_box(rng, 56, 10, 22, x_range), _shade(rng, colour))
    return Drawn(image, answer, {"colour": colour, "shape": kind})


def _draw_count(rng: np.random.Generator, answer: str) -> Drawn:
    image, draw = _background(rng, 112)
    boxes: list[tuple[int, int, int, int]] = []
    while len(boxes) < int(answer):
        box = _random_box(rng, 112, 14, 26)
        # Keep a 3-pixel gap between shapes so each one stays a separate blob.
        if all(box[0] > b[2] + 3 or b[0] > box[2] + 3 or box[1] > b[3] + 3 or b[1] > box[3] + 3 for b in boxes):
            boxes.append(box)
    for box in boxes:
        _shape(draw, str(rng.choice(SHAPES)), box, _shade(rng, str(rng.choice(list(COLOURS)))))
    return Drawn(image, answer, {"count": answer})


MOTION_FRAMES = 4
MOTION_SIZE = 112


def _draw_motion(rng: np.random.Generator, answer: str) -> Drawn:
    """One shape moving `answer`-wards by a fixed step per frame, along a random row from a random start."""
    colour, kind = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
    side = int(rng.integers(18, 27))
    step = int(rng.integers(12, 19))
    travel = step * (MOTION_FRAMES - 1)
    x0 = int(rng.integers(0, MOTION_SIZE - side - travel + 1))
    y0 = int(rng.integers(0, MOTION_SIZE - side + 1))
    grey = int(rng.integers(225, 256))
    fill = _shade(rng, colour)
    frames = []
    for i in range(MOTION_FRAMES):
        image = Image.new("RGB", (MOTION_SIZE, MOTION_SIZE), (grey, grey, grey))
        x = x0 + i * step if answer == "right" else x0 + travel - i * step
        _shape(ImageDraw.Draw(image), kind, (x, y0, x + side - 1, y0 + side - 1), fill)
        frames.append(image)
    return Drawn(frames, answer, {"colour": colour, "shape": kind})


def _draw_last_colour(rng: np.random.Generator, answer: str) -> Drawn:
    """The same shape in the same place for 4 frames: another colour in frames 0-1, the answer's in frames 2-3."""
    first = str(rng.choice([c for c in COLOURS if c != answer]))
    kind = str(rng.choice(SHAPES))
    box = _random_box(rng, MOTION_SIZE, 32, 64)
    grey = int(rng.integers(225, 256))
    frames = []
    for colour in (first, first, answer, answer):
        image = Image.new("RGB", (MOTION_SIZE, MOTION_SIZE), (grey, grey, grey))
        _shape(ImageDraw.Draw(image), kind, box, _shade(rng, colour))
        frames.append(image)
    return Drawn(frames, answer, {"colour": answer, "shape": kind})


TASKS: dict[str, SyntheticTask] = {
    task.name: task
    for task in (
        SyntheticTask("colour", "What colour is the shape? Answer with one word.", tuple(COLOURS), 56, _draw_colour),
        SyntheticTask("shape", "Which shape is in the image? Answer with one word.", SHAPES, 56, _draw_shape),
        SyntheticTask("position", "Is the shape on the left or the right? Answer with one word.",
                      ("left", "right"), 56, _draw_position),
        SyntheticTask("count", "How many shapes are there? Answer with a number.", ("1", "2", "3", "4"), 112,
                      _draw_count),
        SyntheticTask("motion", "Does the shape move to the left or to the right? Answer with one word.",
                      ("left", "right"), MOTION_SIZE, _draw_motion, video=True),
        SyntheticTask("last_colour", "What colour is the shape at the end of the video? Answer with one word.",
                      tuple(COLOURS), MOTION_SIZE, _draw_last_colour, video=True),
    )
}
DEFAULT_TASK = "colour"


def get_task(name: str) -> SyntheticTask:
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name]


# ---------------------------------------------------------------------------------------------------- rows


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def generate_rows(task: str, n: int, seed: int, split: str, exclude: set[str] = frozenset()) -> list[dict]:
    """`n` rows of the verl schema for one split; images whose PNG sha256 is in `exclude` are redrawn.

    The split name is part of the generator's seed, so train and val draw different streams; `exclude` (the other
    split's hashes) makes them disjoint even where two draws happen to give identical pixels.
    """
    spec = get_task(task)
    rng = np.random.default_rng([seed, GENERATOR_VERSION, int.from_bytes(split.encode(), "little")])
    # Balanced labels in a seeded order: every answer is equally common and carries no order signal.
    labels = [spec.answers[i % len(spec.answers)] for i in rng.permutation(n)]
    rows = []
    for index, answer in enumerate(labels):
        while True:
            drawn = spec.draw(rng, answer)
            frames = [png_bytes(f) for f in (drawn.image if spec.video else [drawn.image])]
            if hashlib.sha256(b"".join(frames)).hexdigest() not in exclude:
                break
        media = [{"bytes": f, "path": None} for f in frames]
        rows.append({
            "data_source": spec.data_source,
            "prompt": [{"role": "user", "content": ("<video>" if spec.video else "<image>") + spec.question}],
            "images": [] if spec.video else media,
            **({"videos": [media]} if spec.video else {}),
            "ability": "visual",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "task": task, "answer": answer,
                           "question": spec.question, **{k: drawn.details.get(k, "") for k in _DETAIL_KEYS}},
        })
    return rows


_DETAIL_KEYS = ("colour", "shape", "count")
"""Fixed extra_info fields (empty where a task has no such fact) so every task's parquet has one schema."""


def image_hashes(rows: list[dict]) -> set[str]:
    """sha256 of each row's image (of a video row: of its frames' PNG bytes joined), as generate_rows excludes."""
    out = {hashlib.sha256(image["bytes"]).hexdigest() for row in rows for image in row["images"]}
    out |= {hashlib.sha256(b"".join(f["bytes"] for f in video)).hexdigest() for row in rows
            for video in row.get("videos", [])}
    return out


def write_rows(rows: list[dict], path: str | os.PathLike) -> Path:
    """Writes rows as parquet atomically (temp file + rename): a reader never sees a half-written file.

    Written through `datasets` with an Image feature, exactly as verl's preprocessing scripts write theirs, so the
    file reads back as {bytes, path} structs with pyarrow and as images with `datasets`.
    """
    import datasets
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    videos = {"videos": datasets.List(datasets.List(datasets.Image()))} if rows and "videos" in rows[0] else {}
    features = datasets.Features({
        "data_source": datasets.Value("string"),
        "prompt": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "images": datasets.List(datasets.Image()),
        **videos,
        "ability": datasets.Value("string"),
        "reward_model": {"style": datasets.Value("string"), "ground_truth": datasets.Value("string")},
        "extra_info": {"split": datasets.Value("string"), "index": datasets.Value("int64"),
                       "task": datasets.Value("string"), "answer": datasets.Value("string"),
                       "question": datasets.Value("string"),
                       **{key: datasets.Value("string") for key in _DETAIL_KEYS}},
    })
    table = datasets.Dataset.from_list(rows, features=features)
    # The arrow table carries the features in its schema metadata, as `Dataset.to_parquet` writes it.
    return replace_atomically(path, lambda tmp: pq.write_table(table.data.table, tmp))


def write_synthetic(out_dir: str | os.PathLike, task: str = DEFAULT_TASK, n_train: int = 2048, n_val: int = 128,
                    seed: int = 0) -> tuple[Path, Path]:
    """Writes `train.parquet` and `val.parquet` of a task into out_dir; returns their paths (train, val).

    Deterministic: the same (task, n_train, n_val, seed) gives byte-identical files. The val split is drawn first and
    the train split never repeats one of its images.
    """
    if n_train < 0 or n_val < 0:
        raise ValueError(f"split sizes must be >= 0, got n_train={n_train}, n_val={n_val}")
    val_rows = generate_rows(task, n_val, seed, "val")
    train_rows = generate_rows(task, n_train, seed, "train", exclude=image_hashes(val_rows))
    out_dir = Path(out_dir)
    return write_rows(train_rows, out_dir / "train.parquet"), write_rows(val_rows, out_dir / "val.parquet")
