"""mrope position ids: equal to transformers' get_rope_index on generated batches (0-3 images of random grids, first,
in the middle or last, left, right or no padding, holes in the mask), on each embedded dense mrope family
(Qwen2.5-VL's `Qwen2_5_VLModel.get_rope_index`, Qwen3-VL's `Qwen3VLModel.get_rope_index`, Qwen3.5's
`Qwen3_5Model.get_rope_index` and GLM-4.1V's `Glm4vModel.get_rope_index`). Real requests, every family's, are the
family matrix's (tests/families/test_family_matrix.py)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.processors.helpers import first_difference, hf_rope_index
from vlmrl.processors.loading import load_processor
from vlmrl.processors.rope import mrope_position_ids

NUM_GENERATED_CASES = 64
PLACEMENTS = ("first", "middle", "last")
PADDINGS = ("left", "left", "right", "none")


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3-vl", "tiny-qwen3.5", "tiny-glm4v"])
def model_path(request):
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built(request.param))


@pytest.fixture(scope="module")
def processor(model_path):
    return load_processor(model_path)


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_path).eval()


def _row(rng: random.Random, processor, num_images: int, placement: str) -> tuple[list[int], list[list[int]]]:
    """Expanded ids of one prompt: text, then `num_images` images (patch grids of different sizes) placed first,
    in the middle or last, each wrapped in vision start/end tokens as the chat template does."""
    # the delimiters the chat template puts around an image (GLM-4.1V: <|begin_of_image|> / <|end_of_image|>)
    qwen = processor.family.inputs.image_placeholder == "<|image_pad|>"
    start, end = ("<|vision_start|>", "<|vision_end|>") if qwen else ("<|begin_of_image|>", "<|end_of_image|>")
    vision_start, vision_end = processor.tokenizer.convert_tokens_to_ids([start, end])

    def text(min_len: int) -> list[int]:
        return [rng.randrange(20, 700) for _ in range(rng.randint(min_len, 6))]

    ids, grids = ([] if placement == "first" else text(1)), []
    for i in range(num_images):
        t = 2 if rng.random() < 0.1 else 1  # a temporal grid > 1 is legal input; transformers spaces it by 1
        h, w = 2 * rng.randint(1, 6), 2 * rng.randint(1, 6)
        grids.append([t, h, w])
        ids += [vision_start] + [processor.image_token_id] * (t * h * w // 4) + [vision_end]
        if i < num_images - 1 or placement == "middle":
            ids += text(0 if placement != "middle" else 1)
    if placement == "last" and num_images == 0:
        ids += text(1)
    return ids or text(1), grids


def _batch(rows: list[tuple[list[int], list[list[int]]]], padding: str, pad_id: int, extra: int):
    length = max(len(ids) for ids, _ in rows) + extra
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, (ids, _) in enumerate(rows):
        sl = slice(length - len(ids), length) if padding == "left" else slice(0, len(ids))
        input_ids[i, sl] = torch.tensor(ids)
        mask[i, sl] = 1
    grids = [g for _, row_grids in rows for g in row_grids]
    return input_ids, (None if padding == "none" else mask), (torch.tensor(grids) if grids else None)


@pytest.mark.parametrize("case", range(NUM_GENERATED_CASES))
def test_generated_batch_equals_transformers(case, processor, hf_model):
    rng = random.Random(case)
    num_images, placement, padding = case % 4, PLACEMENTS[(case // 4) % 3], PADDINGS[(case // 12) % 4]
    # the first row follows the case's pattern; the others mix 0-3 images and lengths
    rows = [_row(rng, processor, num_images, placement)]
    rows += [_row(rng, processor, rng.randint(0, 3), rng.choice(PLACEMENTS)) for _ in range(rng.randint(0, 3))]
    if padding == "none":  # no padding at all: every row the same length
        rows = [rows[0]]
    input_ids, mask, grid = _batch(rows, padding, processor.pad_token_id, extra=rng.randint(0, 3))

    expected = hf_rope_index(hf_model, input_ids, mask, grid, processor.image_token_id)
    actual = processor.position_ids(input_ids, mask, grid)
    assert actual.shape == (3, *input_ids.shape) and actual.dtype == torch.long
    assert torch.equal(expected, actual), first_difference(expected, actual)


def test_padding_holes_in_the_middle_equal_transformers(processor, hf_model):
    """Attended tokens are laid out as if packed, as transformers does, whatever the mask pattern."""
    rng = random.Random(7)
    rows = [_row(rng, processor, 2, "middle"), _row(rng, processor, 1, "first")]
    input_ids, mask, grid = _batch(rows, "right", processor.pad_token_id, extra=4)
    mask[0, 1] = 0  # a hole inside the text before the first image
    expected = hf_rope_index(hf_model, input_ids, mask, grid, processor.image_token_id)
    assert torch.equal(expected, processor.position_ids(input_ids, mask, grid))


def test_text_only_batch_counts_attended_tokens():
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = mrope_position_ids(ids, mask, None, image_token_id=99)
    assert positions[:, 0].tolist() == [[0, 0, 0, 1, 2]] * 3
    assert positions[:, 1].tolist() == [[0, 1, 2, 3, 4]] * 3


def test_image_count_mismatch_is_an_error_naming_the_images():
    ids = torch.tensor([[1, 9, 9, 9, 9, 2, 1, 9, 9, 9, 9, 2]])
    with pytest.raises(ValueError, match="image_grid_thw has 1 images but the ids hold 2"):
        mrope_position_ids(ids, None, torch.tensor([[1, 4, 4]]), image_token_id=9)


def test_image_token_count_mismatch_names_the_row():
    ids = torch.tensor([[1, 9, 9, 9, 9, 2], [1, 9, 9, 9, 2, 3]])  # row 1: 3 tokens for a 4-token grid
    with pytest.raises(ValueError, match="batch row 1: image 1 has 3 image tokens but its grid needs 4"):
        mrope_position_ids(ids, None, torch.tensor([[1, 4, 4], [1, 4, 4]]), image_token_id=9)


def test_a_masked_hole_inside_an_image_is_an_error():
    ids = torch.tensor([[1, 9, 9, 9, 9, 2]])
    mask = torch.tensor([[1, 1, 1, 0, 1, 1]])
    with pytest.raises(ValueError, match="image_grid_thw has 1 images but the ids hold 2 image runs"):
        mrope_position_ids(ids, mask, torch.tensor([[1, 4, 4]]), image_token_id=9)
