"""Test helpers shared by tests/processors and tests/batch: synthetic images, rows, the transformers reference."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image


def noise_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A deterministic random-pixel image (every resize difference shows in its bytes)."""
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode=mode)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_row(question: str, images: list, answer: str = "a", data_source: str = "test") -> dict:
    """A verl/EasyR1 row: `<image>` markers in the prompt text, images in `images`."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question}],
        "images": images,
        "reward_model": {"ground_truth": answer},
        "extra_info": {"split": "test"},
    }


def hf_rope_index(
    hf_model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, grid: torch.Tensor | None,
    image_token_id: int,
) -> torch.Tensor:
    """transformers' own `get_rope_index` of the model's family, fed like its processor feeds it (mm_token_type_ids: 1 on
    image tokens, 0 elsewhere)."""
    mm_token_type_ids = (input_ids == image_token_id).to(torch.int32)
    positions, _ = hf_model.model.get_rope_index(
        input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=grid, attention_mask=attention_mask
    )
    return positions


def first_difference(expected: torch.Tensor, actual: torch.Tensor) -> str:
    """Where two (3, B, L) position tensors first differ, for assertion messages."""
    if expected.shape != actual.shape:
        return f"shapes differ: transformers {tuple(expected.shape)} vs vlmrl {tuple(actual.shape)}"
    diff = (expected != actual).nonzero()
    if not len(diff):
        return "equal"
    axis, row, col = diff[0].tolist()
    return (f"first difference at axis {axis}, row {row}, column {col}: transformers {int(expected[axis, row, col])} "
            f"vs vlmrl {int(actual[axis, row, col])} ({len(diff)} differing entries)")
