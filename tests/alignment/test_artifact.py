"""The validation artifact round-trips, and every way a file can be unreadable is reported by name and line."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from vlmrl.alignment.artifact import (
    FORMAT_VERSION,
    ArtifactError,
    ArtifactMeta,
    DatasetIdentity,
    ValidationRecord,
    read_artifact,
    thumbnail_png_base64,
    write_artifact,
)


def _meta(fingerprint: str = "abc") -> ArtifactMeta:
    return ArtifactMeta(
        backend="vllm",
        engine="vllm",
        engine_version="0.0",
        model_path="tiny",
        dataset=DatasetIdentity(paths=["synthetic:val"], rows=2, fingerprint=fingerprint),
        sampling={"n": 1, "temperature": 0.0},
        config={"data": {"max_pixels": 12544}},
    )


def _record(index: int, ids=(5, 6, 7)) -> ValidationRecord:
    return ValidationRecord(
        uid=f"u{index}",
        index=index,
        sample_index=0,
        data_source="synthetic",
        prompt_ids=[1, 2, 3],
        expanded_prompt_length=18,
        image_hashes=["h"],
        image_sizes=[[112, 112]],
        image_grid_thw=[[1, 8, 8]],
        response_ids=list(ids),
        response_text="abc",
        response_logprobs=[-0.1] * len(ids),
        finish_reason="stop",
        reward=1.0,
        reward_extra={"accuracy": 1.0},
        ground_truth="red",
        top_logprobs=[[[t, -0.1], [t + 1, -2.0]] for t in ids],
    )


def test_round_trip_keeps_every_field(tmp_path):
    path = write_artifact(tmp_path / "a.jsonl", _meta(), [_record(0), _record(1)])
    meta, records = read_artifact(path)
    assert meta.dataset.fingerprint == "abc" and meta.created_at and meta.config["data"]["max_pixels"] == 12544
    assert records == [_record(0), _record(1)]
    header = json.loads(path.read_text().splitlines()[0])
    assert header["kind"] == "vlmrl.validation" and header["format_version"] == FORMAT_VERSION
    assert not list(tmp_path.glob(".*.tmp")), "the temporary file must be renamed, not left behind"


def test_truncated_mid_line_names_the_line(tmp_path):
    path = write_artifact(tmp_path / "a.jsonl", _meta(), [_record(0), _record(1)])
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ArtifactError, match=r"truncated.*line 3"):
        read_artifact(path)


def test_truncated_at_a_line_boundary_is_caught_by_the_header_count(tmp_path):
    path = write_artifact(tmp_path / "a.jsonl", _meta(), [_record(0), _record(1)])
    path.write_text("\n".join(path.read_text().splitlines()[:2]) + "\n")
    with pytest.raises(ArtifactError, match="promises 2 records, the file holds 1"):
        read_artifact(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty file"),
        ("not json\n", "line 1 is not JSON"),
        ('{"kind": "other"}\n', "not a vlmrl validation header"),
        ('{"kind": "vlmrl.validation", "format_version": 99, "num_records": 0, "meta": {}}\n', "format_version 99"),
        ('{"kind": "vlmrl.validation", "format_version": 1, "num_records": 0, "meta": {}}\n', "header meta"),
    ],
)
def test_foreign_or_unknown_files_are_rejected(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ArtifactError, match=message):
        read_artifact(path)


def test_missing_file_and_inconsistent_record(tmp_path):
    with pytest.raises(ArtifactError, match="no such file"):
        read_artifact(tmp_path / "nope.jsonl")
    bad = _record(0)
    bad.response_logprobs = [-0.1]
    path = write_artifact(tmp_path / "a.jsonl", _meta(), [bad])
    with pytest.raises(ArtifactError, match=r"row 0, sample 0\): 1 logprobs for 3 response tokens"):
        read_artifact(path)


def test_duplicate_sample_is_rejected(tmp_path):
    path = write_artifact(tmp_path / "a.jsonl", _meta(), [_record(0), _record(0)])
    with pytest.raises(ArtifactError, match="row 0 sample 0 appears twice"):
        read_artifact(path)


def test_thumbnail_is_small_png():
    encoded = thumbnail_png_base64(Image.new("RGB", (448, 224), (200, 10, 10)))
    import base64
    import io

    thumb = Image.open(io.BytesIO(base64.b64decode(encoded)))
    assert thumb.format == "PNG" and max(thumb.size) == 96 and thumb.size == (96, 48)


def test_records_from_rollout_with_the_real_processor(tiny_model_path, tmp_path):
    from vlmrl.alignment.artifact import records_from_rollout
    from vlmrl.processors.loading import load_processor
    from vlmrl.types import RolloutResult

    processor = load_processor(tiny_model_path)
    row = {"prompt": [{"role": "user", "content": "<image>What colour is it?"}],
           "images": [Image.new("RGB", (112, 112), (250, 0, 0))], "data_source": "synthetic/colour",
           "reward_model": {"ground_truth": "red"}}
    request = processor.build_request(row, index=7)
    text_only = processor.build_request({"prompt": "Say hi", "data_source": "text"}, index=8)
    eos = processor.eos_token_ids[0]
    results = [
        RolloutResult(request.uid, 0, [40, 41, eos], [-1.0, -2.0, -0.5], "stop", [{40: -1.0, 42: -1.5}] * 3),
        RolloutResult(request.uid, 1, [43], [-3.0], "length", [{43: -3.0}]),
        RolloutResult(text_only.uid, 0, [44], [-0.1], "length"),
    ]
    records = records_from_rollout([request, text_only], results, [1.0, 0.0, 0.5], processor,
                                   reward_extras=[{"accuracy": 1.0}, {"accuracy": 0.0}, {}])
    first, second, third = records
    assert (first.index, first.sample_index, second.sample_index, third.index) == (7, 0, 1, 8)
    assert first.image_sizes == [[112, 112]] and first.image_grid_thw == [[1, 8, 8]]
    assert first.expanded_prompt_length == len(first.prompt_ids) - 1 + 16, "112x112 -> 16 image tokens"
    assert first.top_logprobs[0] == [[40, -1.0], [42, -1.5]] and third.top_logprobs is None
    assert first.response_text.endswith(processor.tokenizer.decode([eos])), "special tokens are kept in the text"
    assert first.thumbnails and second.thumbnails is None, "thumbnails on sample 0 of a row only"
    assert third.image_hashes == [] and third.thumbnails is None and third.expanded_prompt_length == len(third.prompt_ids)
    meta = _meta()
    meta.dataset.rows = 2
    meta_back, back = read_artifact(write_artifact(tmp_path / "x.jsonl", meta, records))
    assert back == records
    with pytest.raises(ValueError, match="3 results but 2 rewards"):
        records_from_rollout([request, text_only], results, [1.0, 0.0], processor)


def test_engine_info_names_the_package_and_its_version():
    import transformers

    from vlmrl.alignment.artifact import engine_info

    assert engine_info("hf") == ("transformers", transformers.__version__)
    assert engine_info("no-such-engine") == ("no-such-engine", "unknown")


def test_the_format_and_the_compare_tool_load_without_torch():
    """An artifact can be read (and two compared) on a machine without torch: the format imports none of it, and no
    trainer code comes along (the run config's trainer section, a plain dataclass, is all compare reads of it)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, vlmrl.alignment.artifact, vlmrl.alignment.compare\n"
            "print(sorted(m for m in sys.modules if m in ('torch', 'transformers')\n"
            "             or m.startswith('vlmrl.trainer.') and m != 'vlmrl.trainer.config'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.strip() == "[]", done.stdout
