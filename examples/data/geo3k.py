r"""Turn hiyouga/geometry3k into the verl/EasyR1 parquet schema (train.parquet, test.parquet), as verl's
examples/data_preprocess/geo3k.py does, so the files train unchanged in vlmrl and in verl.

    python examples/data/geo3k.py --local_dir ~/data/geo3k                     # from the HF hub
    python examples/data/geo3k.py --local_dir ~/data/geo3k --input_dir DIR     # from a local copy

The local copy is either a hub snapshot (a folder with data/train-*.parquet, data/test-*.parquet, ...) or a folder
written by `DatasetDict.save_to_disk`. Source columns: images (a list of images), problem (text that starts with
`<image>`), answer. Each row becomes:

    data_source  "hiyouga/geometry3k" (what the reward's auto dispatch and verl's default_compute_score look for)
    prompt       [{"role": "user", "content": problem + " " + INSTRUCTION}]
    images       the source images, bytes kept as they are ({bytes, path} structs, an Image feature)
    ability      "math"
    reward_model {"style": "rule", "ground_truth": answer}
    extra_info   {"split", "index", "answer", "question"}
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import datasets

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = (
    r"You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    r"The reasoning process MUST BE enclosed within <think> </think> tags. "
    r"The final answer MUST BE put in \boxed{}."
)
SPLITS = {"train": "train.parquet", "test": "test.parquet"}
"""Source split -> output file (verl trains on train and validates on test)."""


def load_source(input_dir: str | None) -> datasets.DatasetDict:
    """The raw dataset: from the hub without input_dir, else from a local snapshot or save_to_disk folder."""
    if input_dir is None:
        return datasets.load_dataset(DATA_SOURCE)
    folder = Path(input_dir).expanduser()
    if (folder / "dataset_dict.json").exists():
        return datasets.load_from_disk(str(folder))
    return datasets.load_dataset(str(folder))


def to_verl_schema(source: datasets.Dataset, split: str) -> datasets.Dataset:
    """One split in the verl schema; images keep their original encoded bytes (never decoded and re-encoded)."""
    missing = {"images", "problem", "answer"} - set(source.column_names)
    if missing:
        raise ValueError(f"split {split!r} lacks columns {sorted(missing)} (has {source.column_names})")
    raw = source.cast_column("images", datasets.List(datasets.Image(decode=False)))

    def convert(example: dict, index: int) -> dict:
        problem, answer = example["problem"], example["answer"]
        return {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
            "images": example["images"],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "answer": answer, "question": problem},
        }

    converted = raw.map(convert, with_indices=True, remove_columns=raw.column_names, desc=f"geo3k {split}")
    return converted.cast_column("images", datasets.List(datasets.Image()))


def write_parquet(dataset: datasets.Dataset, path: Path) -> None:
    """Atomic write: a temp file in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        dataset.to_parquet(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_dir", default="~/data/geo3k", help="where train.parquet and test.parquet go")
    parser.add_argument("--input_dir", default=None, help="a local copy of hiyouga/geometry3k (else the HF hub)")
    args = parser.parse_args(argv)

    source = load_source(args.input_dir)
    out_dir = Path(args.local_dir).expanduser()
    written = {}
    for split, name in SPLITS.items():
        if split not in source:
            raise SystemExit(f"the source has no {split!r} split (splits: {list(source)})")
        written[split] = out_dir / name
        write_parquet(to_verl_schema(source[split], split), written[split])
        print(f"{split}: {source[split].num_rows} rows -> {written[split]}")
    return written


if __name__ == "__main__":
    main()
