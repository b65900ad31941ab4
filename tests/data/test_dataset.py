"""Loading verl-schema parquet, data specs, the resumable batch order, and rows -> requests with counted skips."""

from __future__ import annotations

import io
import os

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vlmrl.data.dataset import (
    BatchSampler,
    DataError,
    PromptQueue,
    RLDataset,
    build_requests,
    load_dataset,
    resolve_files,
    sequential_batches,
)
from vlmrl.processors.errors import BadRowError, FilteredRow
from vlmrl.types import RolloutRequest


def _png(colour: tuple[int, int, int], size: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _verl_rows(n: int) -> dict[str, list]:
    """Columns as verl's examples/data_preprocess/geo3k.py produces them (images as an Image feature)."""
    return {
        "data_source": ["hiyouga/geometry3k"] * n,
        "prompt": [[{"role": "user", "content": f"<image>Find x{i}. Think, then put it in \\boxed{{}}."}]
                   for i in range(n)],
        "images": [[{"bytes": _png((10 * i, 0, 0)), "path": None}] for i in range(n)],
        "ability": ["math"] * n,
        "reward_model": [{"style": "rule", "ground_truth": str(i)} for i in range(n)],
        "extra_info": [{"split": "train", "index": i, "answer": str(i), "question": f"Find x{i}."} for i in range(n)],
    }


def test_verl_written_parquet_loads_unchanged_with_images_as_bytes_structs(tmp_path):
    columns = _verl_rows(5)
    features = datasets.Features({
        "data_source": datasets.Value("string"),
        "prompt": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "images": datasets.List(datasets.Image()),
        "ability": datasets.Value("string"),
        "reward_model": {"style": datasets.Value("string"), "ground_truth": datasets.Value("string")},
        "extra_info": {"split": datasets.Value("string"), "index": datasets.Value("int64"),
                       "answer": datasets.Value("string"), "question": datasets.Value("string")},
    })
    datasets.Dataset.from_dict(columns, features=features).to_parquet(str(tmp_path / "train.parquet"))

    data = RLDataset([tmp_path / "train.parquet"])
    assert len(data) == 5
    row = data[3]
    assert row["prompt"] == columns["prompt"][3]
    assert row["images"] == [{"bytes": columns["images"][3][0]["bytes"], "path": None}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "3"}
    assert row["extra_info"]["index"] == 3 and row["ability"] == "math"
    assert data.data_sources() == ["hiyouga/geometry3k"]


def test_image_paths_relative_to_the_parquet_folder_resolve_and_columns_can_be_renamed(tmp_path, monkeypatch):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(_png((0, 255, 0)))
    table = pa.table({
        "data_source": ["mine"],
        "messages": [[{"role": "user", "content": "<image>What is it?"}]],
        "image": [{"bytes": None, "path": "imgs/a.png"}],  # one image per row, not a list
        "reward_model": [{"style": "rule", "ground_truth": "green"}],
    })
    pq.write_table(table, tmp_path / "d.parquet")
    monkeypatch.chdir(tmp_path.parent)  # the path does not exist from the working directory

    row = RLDataset([tmp_path / "d.parquet"], prompt_key="messages", image_key="image")[0]
    assert row["prompt"] == [{"role": "user", "content": "<image>What is it?"}]
    assert row["images"] == [{"bytes": None, "path": str((tmp_path / "imgs" / "a.png").resolve())}]
    assert row["extra_info"] == {}
    with pytest.raises(ValueError, match="data.prompt_key"):
        RLDataset([tmp_path / "d.parquet"])


def test_rows_of_several_files_are_indexed_in_order(tmp_path):
    for name, n in (("a", 3), ("b", 4)):
        datasets.Dataset.from_dict(_verl_rows(n)).to_parquet(str(tmp_path / f"{name}.parquet"))
    data = load_dataset(f"{tmp_path}/b.parquet, {tmp_path}/a.parquet")
    assert len(data) == 7
    assert [data[i]["reward_model"]["ground_truth"] for i in range(7)] == ["0", "1", "2", "3", "0", "1", "2"]
    assert data.locate(5) == (tmp_path / "a.parquet", 1)
    assert resolve_files(str(tmp_path)) == [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    assert resolve_files(f"{tmp_path}/*.parquet") == [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        resolve_files(f"{tmp_path}/a.parquet,{tmp_path}/missing.parquet")
    with pytest.raises(IndexError, match="row 7"):
        data[7]


def test_synthetic_spec_generates_once_into_the_cache_and_picks_the_split(tmp_path):
    sizes = dict(synthetic_train_size=12, synthetic_val_size=4, root=tmp_path)
    train = load_dataset("synthetic", "train", **sizes)
    val = load_dataset("synthetic", "val", **sizes)
    assert (len(train), len(val)) == (12, 4)
    assert train.data_sources() == ["synthetic/colour"]
    assert val[0]["extra_info"]["split"] == "val"
    mtime = os.stat(train.files[0]).st_mtime_ns
    assert load_dataset("synthetic:colour@train", "val", **sizes).files == train.files
    assert os.stat(train.files[0]).st_mtime_ns == mtime, "a second load must reuse the cached file"
    assert load_dataset("synthetic:count", "train", **sizes).data_sources() == ["synthetic/count"]
    with pytest.raises(ValueError, match="unknown synthetic task"):
        load_dataset("synthetic:nope", **sizes)


def test_resumed_sampler_yields_the_same_batches_as_an_uninterrupted_one():
    straight = BatchSampler(10, 3, seed=7)
    expected = [next(straight) for _ in range(8)]  # crosses two epoch ends
    first = BatchSampler(10, 3, seed=7)
    got = [next(first) for _ in range(4)]
    resumed = BatchSampler(10, 3, seed=7)
    resumed.load_state_dict(first.state_dict())
    got += [next(resumed) for _ in range(4)]
    assert got == expected
    assert expected[0] != expected[3] or expected[1] != expected[4], "epochs must be shuffled differently"


def test_sampler_epochs_cover_each_row_once_and_never_mix_epochs_in_a_batch():
    sampler = BatchSampler(10, 3, seed=0)
    epoch = [next(sampler) for _ in range(sampler.batches_per_epoch)]
    assert sampler.batches_per_epoch == 3
    assert len({i for batch in epoch for i in batch}) == 9, "drop_last skips one row, repeats none"
    assert sampler.state_dict()["epoch"] == 0
    next(sampler)
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["offset"] == 3
    in_order = BatchSampler(5, 2, shuffle=False, drop_last=False)
    assert [next(in_order) for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]
    assert sequential_batches(5, -1) == [[0, 1, 2, 3, 4]]


def test_sampler_refuses_a_state_from_another_setup():
    state = BatchSampler(10, 3, seed=7).state_dict()
    with pytest.raises(ValueError, match="seed=7"):
        BatchSampler(10, 3, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="train_batch_size"):
        BatchSampler(2, 3)


class _CountingProcessor:
    """Stands in for the processor only to drive build_requests' counting: row i is filtered, bad or fine."""

    def __init__(self, filtered=(), bad=(), broken=()):
        self.filtered, self.bad, self.broken = set(filtered), set(bad), set(broken)

    def build_request(self, row, index=-1):
        if index in self.filtered:
            raise FilteredRow(index, "prompt has 2000 tokens > max_prompt_length 1024")
        if index in self.bad:
            raise BadRowError(index, "2 <image> placeholders but 1 image")
        if index in self.broken:
            raise KeyError("content")
        return RolloutRequest(uid=f"u{index}", prompt_ids=[1], index=index,
                              ground_truth=row["reward_model"]["ground_truth"])


def test_build_requests_counts_filtered_rows_and_names_bad_ones(tmp_path):
    datasets.Dataset.from_dict(_verl_rows(6)).to_parquet(str(tmp_path / "d.parquet"))
    data = RLDataset([tmp_path / "d.parquet"])
    batch = build_requests(_CountingProcessor(filtered={1, 4}), data, [0, 1, 2, 4, 5])
    assert [r.index for r in batch.requests] == [0, 2, 5]
    assert [r.ground_truth for r in batch.requests] == ["0", "2", "5"]
    assert batch.num_skipped == 2 and [s.row_index for s in batch.skipped] == [1, 4]
    with pytest.raises(BadRowError, match="row 3: 2 <image>"):
        build_requests(_CountingProcessor(bad={3}), data, [2, 3])
    with pytest.raises(BadRowError, match=r"row 5: KeyError: 'content' \(row 5 of .*d.parquet\)"):
        build_requests(_CountingProcessor(broken={5}), data, [5])


def test_module_doctests():
    import doctest

    import vlmrl.data.dataset

    result = doctest.testmod(vlmrl.data.dataset)
    assert result.attempted > 0 and result.failed == 0


def test_synthetic_rows_become_requests_with_one_short_token_answer(tmp_path, tiny_model_path):
    from vlmrl.data.synthetic import TASKS
    from vlmrl.processors.loading import load_processor

    processor = load_processor(tiny_model_path)
    for task in sorted(TASKS):
        for answer in TASKS[task].answers:  # answers the tiny model can say in one or two tokens
            assert len(processor.tokenizer.encode(answer, add_special_tokens=False)) <= 2, (task, answer)
        data = load_dataset(f"synthetic:{task}", "val", synthetic_train_size=4, synthetic_val_size=4, root=tmp_path)
        batch = build_requests(processor, data, range(len(data)))
        assert batch.num_skipped == 0 and [r.index for r in batch.requests] == [0, 1, 2, 3]
        for index, request in enumerate(batch.requests):
            video = TASKS[task].video
            pad = processor.video_token_id if video else processor.image_token_id
            assert request.prompt_ids.count(pad) == 1
            assert request.ground_truth == data[index]["reward_model"]["ground_truth"]
            assert request.data_source == f"synthetic/{task}"
            size = request.videos[0].frames.shape[2:0:-1] if video else request.images[0].size
            assert tuple(size) == (TASKS[task].image_size,) * 2, "already a multiple of 28: not resized"


def test_easyr1_schema_without_data_source_loads_as_unknown(tmp_path):
    """EasyR1's geometry3k columns are images/problem/answer: no data_source, the ground truth in `answer`."""
    pq.write_table(pa.table({"problem": ["<image>Find x."], "answer": ["60"],
                             "images": [[{"bytes": _png((0, 0, 255)), "path": None}]]}), tmp_path / "e.parquet")
    data = RLDataset([tmp_path / "e.parquet"], prompt_key="problem")
    assert data.data_sources() == ["unknown"]
    assert data[0]["data_source"] == "unknown" and data[0]["answer"] == "60"


def test_prompt_queue_hands_out_the_sampler_order_in_any_amounts():
    """Partial rollout takes more or fewer prompts than a batch: together they are the sampler's batches, in order."""
    sampler = BatchSampler(6, 2, seed=3)
    expected = [i for _ in range(6) for i in next(sampler)]
    queue = PromptQueue(BatchSampler(6, 2, seed=3))
    taken = [queue.take(count) for count in (3, 0, 1, 5, 2)]
    assert [len(t) for t in taken] == [3, 0, 1, 5, 2]
    assert sum(taken, []) + queue.pending == expected  # 11 handed out of the 12 drawn (6 batches of 2)


# ------------------------------------------------------------------------------------ data errors name the file


def test_an_empty_parquet_file_is_named_with_no_rows(tmp_path):
    empty = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict(_verl_rows(2)).select([]).to_parquet(str(empty))
    assert pq.read_metadata(empty).num_rows == 0
    with pytest.raises(DataError, match=r"no rows .*empty\.parquet: an empty parquet file"):
        load_dataset(str(empty), "train")


def test_an_empty_validation_set_says_no_rows_not_filtered(tmp_path):
    empty = tmp_path / "test.parquet"
    datasets.Dataset.from_dict(_verl_rows(1)).select([]).to_parquet(str(empty))
    with pytest.raises(DataError, match="no rows") as info:
        load_dataset(str(empty), "val")
    assert "test.parquet" in str(info.value) and "filtered" not in str(info.value)


def test_one_empty_file_among_others_is_fine(tmp_path):
    datasets.Dataset.from_dict(_verl_rows(3)).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_dict(_verl_rows(3)).select([]).to_parquet(str(tmp_path / "b.parquet"))
    assert len(load_dataset(str(tmp_path), "train")) == 3


@pytest.mark.parametrize("content, cause", [(b"", r"an empty file \(0 bytes\)"),
                                            (b"PAR1 not really a parquet file", "ArrowInvalid")])
def test_a_zero_byte_or_garbage_parquet_is_named_with_the_cause(tmp_path, content, cause):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(content)
    with pytest.raises(DataError, match=rf"broken\.parquet: not a readable parquet file \({cause}"):
        load_dataset(str(bad), "train")


def test_a_bad_row_of_the_second_file_names_that_file_and_its_row(tmp_path):
    for name in ("a", "b"):
        datasets.Dataset.from_dict(_verl_rows(3)).to_parquet(str(tmp_path / f"{name}.parquet"))
    data = load_dataset(str(tmp_path), "train")
    with pytest.raises(BadRowError, match=r"row 4: 2 <image> placeholders but 1 image \(row 1 of .*b\.parquet\)"):
        build_requests(_CountingProcessor(bad={4}), data, [0, 4])
