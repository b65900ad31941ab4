"""High-depth images (16-bit, 32-bit int, float) reach the model with their value range, never clipped by PIL."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from vlmrl.data.config import DataConfig
from vlmrl.processors.images import ImageSizing, load_image, resize_image


TINY = ImageSizing(factor=28, min_pixels=3136, max_pixels=12544)


def _resized(image: Image.Image) -> np.ndarray:
    return np.asarray(resize_image(image, TINY), dtype=np.float64)


def _gradient(low: float, high: float, dtype) -> np.ndarray:
    return np.linspace(low, high, 56 * 56).reshape(56, 56).astype(dtype)


def test_a_16_bit_image_is_scaled_by_its_range_not_clipped_to_white():
    # PIL's own RGB conversion clips 16-bit values at 255: this half-bright gradient came out all white
    image = Image.fromarray(_gradient(0, 32767, np.uint16))
    assert image.mode == "I;16"
    pixels = _resized(image)
    assert pixels.shape[-1] == 3 and 60 < pixels.mean() < 68  # 0..32767 of 65535 -> 0..127, mean ~64
    assert pixels.max() <= 128 and pixels.min() < 5


def test_a_16_bit_png_from_bytes_keeps_its_gradient():
    buffer = io.BytesIO()
    Image.fromarray(_gradient(0, 65535, np.uint16)).save(buffer, format="PNG")
    pixels = _resized(load_image({"bytes": buffer.getvalue()}, DataConfig()))
    assert pixels.min() < 5 and pixels.max() > 250 and 120 < pixels.mean() < 135


def test_a_float_image_is_scaled_by_its_min_and_max_not_clipped_to_black():
    image = Image.fromarray(_gradient(0.0, 1.0, np.float32))  # PIL: every value rounds to 0 or 1 of 255
    assert image.mode == "F"
    pixels = _resized(image)
    assert pixels.min() < 5 and pixels.max() > 250 and 120 < pixels.mean() < 135


@pytest.mark.parametrize("low, high", [(0, 100_000), (-70_000, 30_000)])
def test_a_32_bit_int_image_is_scaled_by_its_min_and_max(low, high):
    image = Image.fromarray(_gradient(low, high, np.int32))
    assert image.mode == "I"
    pixels = _resized(image)
    assert pixels.min() < 5 and pixels.max() > 250 and 120 < pixels.mean() < 135


def test_nan_and_constant_float_images_do_not_fail():
    values = _gradient(0.0, 1.0, np.float32)
    values[:4] = np.nan
    assert _resized(Image.fromarray(values)).max() > 250
    assert _resized(Image.fromarray(np.full((56, 56), 7.0, np.float32))).max() == 0


def test_8_bit_images_are_unchanged_by_the_conversion():
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    assert np.array_equal(np.asarray(resize_image(rgb, TINY)), np.asarray(rgb))
