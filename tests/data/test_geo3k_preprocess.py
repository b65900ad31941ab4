"""examples/data/geo3k.py on a small locally made dataset of geometry3k's shape (the hub is unreachable in tests)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import datasets
import pytest
from PIL import Image

from vlmrl.data.dataset import load_dataset
from vlmrl.rewards.base import RewardInput
from vlmrl.rewards.registry import get_reward_fn
from vlmrl.rewards.scoring import compute_rewards

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "data" / "geo3k.py"
SPLIT_SIZES = {"train": 4, "validation": 2, "test": 3}


@pytest.fixture(scope="module")
def geo3k():
    spec = importlib.util.spec_from_file_location("geo3k_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jpeg(shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (60, 40), (shade, 255 - shade, 90)).save(buffer, format="JPEG")
    return buffer.getvalue()


def _fake_geometry3k() -> datasets.DatasetDict:
    """Columns and feature types as hiyouga/geometry3k has them: images (list of Image), problem, answer."""
    features = datasets.Features({"images": datasets.List(datasets.Image()), "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    splits = {}
    for split, n in SPLIT_SIZES.items():
        splits[split] = datasets.Dataset.from_dict({
            "images": [[{"bytes": _jpeg(20 * i + len(split)), "path": None}] for i in range(n)],
            "problem": [f"<image>Find x in the {split} figure {i}." for i in range(n)],
            "answer": [f"{i + 2}\\sqrt{{3}}" for i in range(n)],
        }, features=features)
    return datasets.DatasetDict(splits)


@pytest.mark.parametrize("layout", ["hub_snapshot", "save_to_disk"])
def test_local_copy_becomes_verl_schema_parquet_that_loads_scores_and_builds_requests(
        tmp_path, geo3k, layout, tiny_model_path):
    source = _fake_geometry3k()
    input_dir = tmp_path / "geometry3k"
    if layout == "hub_snapshot":
        for split, data in source.items():
            (input_dir / "data").mkdir(parents=True, exist_ok=True)
            data.to_parquet(str(input_dir / "data" / f"{split}-00000-of-00001.parquet"))
    else:
        source.save_to_disk(str(input_dir))

    written = geo3k.main(["--input_dir", str(input_dir), "--local_dir", str(tmp_path / "out")])
    assert written == {"train": tmp_path / "out" / "train.parquet", "test": tmp_path / "out" / "test.parquet"}

    test_set = load_dataset(str(written["test"]))
    assert len(test_set) == SPLIT_SIZES["test"]
    row = test_set[2]
    problem, answer = source["test"][2]["problem"], source["test"][2]["answer"]
    assert row["data_source"] == "hiyouga/geometry3k" and row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": problem + " " + geo3k.INSTRUCTION}]
    assert row["prompt"][0]["content"].endswith(r"The final answer MUST BE put in \boxed{}.")
    assert row["reward_model"] == {"style": "rule", "ground_truth": answer}
    assert row["extra_info"] == {"split": "test", "index": 2, "answer": answer, "question": problem}
    original = source["test"].cast_column("images", datasets.List(datasets.Image(decode=False)))[2]["images"]
    assert [im["bytes"] for im in row["images"]] == [original[0]["bytes"]], "image bytes must pass through unchanged"
    # verl reads the same file with `datasets`, which must still see images.
    assert isinstance(datasets.Dataset.from_parquet(str(written["train"]))[0]["images"][0], Image.Image)

    fn = get_reward_fn("auto", data_sources=test_set.data_sources())
    right = RewardInput(row["data_source"], rf"<think>30-60-90</think> x = \boxed{{{answer}}}", answer)
    scores, extras, failures = compute_rewards(fn, [right, RewardInput(row["data_source"], r"\boxed{1}", answer)])
    assert (scores, failures) == ([1.0, 0.0], 0)

    from vlmrl.processors.loading import load_processor

    request = load_processor(tiny_model_path).build_request(row, 2)
    assert request.ground_truth == answer and request.data_source == "hiyouga/geometry3k" and len(request.images) == 1


def test_a_source_without_the_geometry3k_columns_is_refused(geo3k):
    with pytest.raises(ValueError, match=r"lacks columns \['answer', 'problem'\]"):
        geo3k.to_verl_schema(datasets.Dataset.from_dict({"images": [[]]}), "train")
