"""Datasets of prompts in the verl/EasyR1 parquet schema, their resumable batch order, and rows -> requests.

A row is a dict with `data_source`, `prompt` (chat messages; a user message's text holds one `<image>` per image),
`images` (a list of {bytes, path} structs), `ability`, `reward_model` ({style, ground_truth}) and `extra_info`.
Files are read with pyarrow, so images stay encoded structs until the processor decodes them (the processor owns
image loading and checks), and a parquet written by verl's preprocessing scripts (e.g. geo3k) loads unchanged.

Data specs (`data.train_files` / `data.val_files`): comma-separated parquet files, globs or folders of parquet files,
or `synthetic[:TASK][@SPLIT]` for the embedded visual task (`vlmrl.data.synthetic`; the split defaults to the one
asked for), generated deterministically into a cache folder the first time.
"""

from __future__ import annotations

import copy
import glob
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from vlmrl.data import synthetic
from vlmrl.processors.errors import BadRowError, FilteredRow
from vlmrl.types import RolloutRequest
from vlmrl.utils.paths import cache_root
from vlmrl.utils.sequences import chunks

logger = logging.getLogger(__name__)

SYNTHETIC = "synthetic"
SPLITS = ("train", "val")


class DataError(ValueError):
    """A data file that cannot be used (unreadable, empty, missing its prompt column, fewer rows than a batch): names
    the file or the setting, and why."""


# ---------------------------------------------------------------------------------------------------- file specs


def cache_dir() -> Path:
    """Where generated synthetic data goes: $VLMRL_CACHE/data, else ~/.cache/vlmrl/data (beside the tiny models)."""
    return cache_root() / "data"


def synthetic_files(task: str, *, n_train: int, n_val: int, seed: int = 0,
                    root: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """(train, val) parquet of a synthetic task, generated once into the cache (a folder named by every input)."""
    synthetic.get_task(task)  # unknown task -> error before touching the disk
    folder = Path(root or cache_dir()) / (
        f"synthetic-{task}-v{synthetic.GENERATOR_VERSION}-seed{seed}-train{n_train}-val{n_val}")
    train, val = folder / "train.parquet", folder / "val.parquet"
    if not (train.exists() and val.exists()):
        logger.info("generating synthetic task %r (%d train / %d val rows, seed %d) into %s",
                    task, n_train, n_val, seed, folder)
        synthetic.write_synthetic(folder, task, n_train=n_train, n_val=n_val, seed=seed)
    return train, val


def parse_synthetic_spec(spec: str, split: str) -> tuple[str, str] | None:
    """`synthetic[:TASK][@SPLIT]` -> (task, split); None when `spec` is not a synthetic spec.

    >>> parse_synthetic_spec("synthetic", "val")
    ('colour', 'val')
    >>> parse_synthetic_spec("synthetic:count@train", "val")
    ('count', 'train')
    >>> parse_synthetic_spec("data/train.parquet", "train") is None
    True
    """
    name, _, spec_split = spec.partition("@")
    kind, _, task = name.partition(":")
    if kind != SYNTHETIC:
        return None
    split = spec_split or split
    if split not in SPLITS:
        raise ValueError(f"data spec {spec!r}: split {split!r} is not one of {SPLITS}")
    return task or synthetic.DEFAULT_TASK, split


def resolve_files(spec: str | Sequence[str], split: str = "train", *, synthetic_train_size: int = 2048,
                  synthetic_val_size: int = 128, synthetic_seed: int = 0,
                  root: str | os.PathLike | None = None) -> list[Path]:
    """Parquet files named by a data spec, in the order given (globs and folders sorted); `split` picks the
    synthetic split. Raises FileNotFoundError naming each part that matched nothing."""
    parts = [p.strip() for p in (spec.split(",") if isinstance(spec, str) else spec) if str(p).strip()]
    if not parts:
        raise ValueError("empty data spec: give parquet file(s) or `synthetic[:TASK]`")
    files: list[Path] = []
    for part in map(str, parts):
        parsed = parse_synthetic_spec(part, split)
        if parsed is not None:
            task, which = parsed
            train, val = synthetic_files(task, n_train=synthetic_train_size, n_val=synthetic_val_size,
                                         seed=synthetic_seed, root=root)
            files.append(train if which == "train" else val)
        elif os.path.isdir(os.path.expanduser(part)):
            found = sorted(Path(os.path.expanduser(part)).glob("*.parquet"))
            if not found:
                raise FileNotFoundError(f"data spec {part!r}: folder holds no *.parquet file")
            files.extend(found)
        else:
            found = sorted(glob.glob(os.path.expanduser(part)))
            if not found:
                raise FileNotFoundError(f"data spec {part!r}: no such file (cwd {os.getcwd()})")
            files.extend(Path(f) for f in found)
    return files


# ---------------------------------------------------------------------------------------------------- dataset


class RLDataset:
    """The rows of one or more parquet files, indexed 0..len-1 across the files in order."""

    def __init__(self, files: Sequence[str | os.PathLike], *, prompt_key: str = "prompt", image_key: str = "images",
                 spec: str | None = None):
        if not files:
            raise ValueError("RLDataset needs at least one parquet file")
        self.files = [Path(f) for f in files]
        self.spec = spec or ",".join(map(str, self.files))
        self.prompt_key, self.image_key = prompt_key, image_key
        self._tables = []
        for path in self.files:
            table = _read_parquet(path)
            if prompt_key not in table.column_names:
                raise DataError(f"{path}: no prompt column {prompt_key!r} (columns: {table.column_names}); "
                                f"set data.prompt_key to the column holding the chat messages")
            if table.num_rows == 0:
                logger.warning("%s: an empty parquet file (0 rows)", path)
            self._tables.append(table)
        self._starts = np.cumsum([0] + [t.num_rows for t in self._tables])
        if len(self) == 0:
            raise DataError(f"dataset {self.spec}: no rows ({', '.join(map(str, self.files))}: "
                            f"{'an empty parquet file' if len(self.files) == 1 else 'empty parquet files'})")
        logger.info("dataset %s: %d rows from %d file(s)", self.spec, len(self), len(self.files))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _table_of(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range: dataset {self.spec} has {len(self)} rows")
        which = int(np.searchsorted(self._starts, index, side="right")) - 1
        return which, index - int(self._starts[which])

    def locate(self, index: int) -> tuple[Path, int]:
        """(file, row within that file) of a dataset index."""
        which, local = self._table_of(index)
        return self.files[which], local

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Row `index` as a dict in the verl schema (a fresh dict: callers may change it)."""
        which, local = self._table_of(index)
        row = self._tables[which].slice(local, 1).to_pylist()[0]
        return self._normalise(row, self.files[which])

    def _normalise(self, row: dict[str, Any], path: Path) -> dict[str, Any]:
        """The verl schema under its usual keys, whatever the prompt/image columns are called."""
        row["prompt"] = row[self.prompt_key]
        images = row.get(self.image_key)
        if images is None:
            images = []
        elif not isinstance(images, list):  # a single image column (one struct / path per row)
            images = [images]
        row["images"] = [_resolve_image_path(image, path.parent) for image in images]
        videos = row.get("videos")
        if videos is not None:  # a video is a path / {bytes, path}, or a list of frame images
            videos = videos if isinstance(videos, list) else [videos]
            row["videos"] = [[_resolve_image_path(f, path.parent) for f in v] if isinstance(v, list)
                             else _resolve_image_path(v, path.parent) for v in videos]
        row.setdefault("data_source", "unknown")
        row.setdefault("extra_info", {})
        if row["extra_info"] is None:
            row["extra_info"] = {}
        return row

    def column(self, name: str) -> list[Any]:
        """One column over all files (e.g. `data_source`), without decoding any other column."""
        values: list[Any] = []
        for path, table in zip(self.files, self._tables, strict=True):
            if name not in table.column_names:
                raise KeyError(f"{path}: no column {name!r} (columns: {table.column_names})")
            values.extend(table.column(name).to_pylist())
        return values

    def data_sources(self) -> list[str]:
        """The distinct data sources, sorted (for per-source metrics and for checking a reward covers them all)."""
        sources: set[str] = set()
        for table in self._tables:  # a file without the column (EasyR1's images/problem/answer) is "unknown"
            names = table.column("data_source").to_pylist() if "data_source" in table.column_names else [None]
            sources.update(source or "unknown" for source in names)
        return sorted(sources)


def _read_parquet(path: Path):
    """The file's pyarrow Table (memory-mapped: images stay encoded until used); DataError naming the file when it is
    not a readable parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path, memory_map=True)
    except (pa.ArrowException, OSError) as err:
        size = path.stat().st_size if path.is_file() else None
        cause = "an empty file (0 bytes)" if size == 0 else f"{type(err).__name__}: {err}"
        raise DataError(f"{path}: not a readable parquet file ({cause})") from err


def _resolve_image_path(image: Any, base: Path) -> Any:
    """A relative image path that does not exist from the working dir but does beside the parquet file is made
    absolute there; everything else is left as it is (verl resolves paths from the working dir)."""
    if isinstance(image, dict) and not image.get("bytes") and image.get("path"):
        image = dict(image, path=_resolve_image_path(image["path"], base))
    elif isinstance(image, str) and not os.path.isabs(image) and "://" not in image and not os.path.exists(image):
        if (base / image).exists():
            return str((base / image).resolve())
    return image


def load_dataset(spec: str, split: str = "train", *, prompt_key: str = "prompt", image_key: str = "images",
                 synthetic_train_size: int = 2048, synthetic_val_size: int = 128, synthetic_seed: int = 0,
                 root: str | os.PathLike | None = None) -> RLDataset:
    """An RLDataset from a data spec (see the module docstring); `split` picks the synthetic split."""
    files = resolve_files(spec, split, synthetic_train_size=synthetic_train_size,
                          synthetic_val_size=synthetic_val_size, synthetic_seed=synthetic_seed, root=root)
    return RLDataset(files, prompt_key=prompt_key, image_key=image_key, spec=spec)


# ---------------------------------------------------------------------------------------------------- batch order


class BatchSampler:
    """Batches of row indices in a deterministic order that can be saved and resumed.

    Epoch e visits the rows in a permutation drawn from (seed, e) alone, so the position (epoch, offset) is the whole
    state: a run resumed from `state_dict()` gets exactly the batches an uninterrupted run would. With drop_last the
    rows left over at an epoch's end (fewer than a batch) are skipped; a batch never spans two epochs, so no row is
    twice in one batch.
    """

    def __init__(self, num_rows: int, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        if num_rows < 1 or (drop_last and batch_size > num_rows):
            raise DataError(f"batch size {batch_size} needs at least that many rows, the dataset has {num_rows}: "
                            f"lower data.train_batch_size or add data")
        self.num_rows, self.batch_size = num_rows, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.offset = 0, 0
        self._order: np.ndarray | None = None

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            self._order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows)
                           if self.shuffle else np.arange(self.num_rows))
        return self._order

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> list[int]:
        """The next batch; never ends (the trainer decides how many steps to take)."""
        left = self.num_rows - self.offset
        if left == 0 or (self.drop_last and left < self.batch_size):
            self.epoch, self.offset, self._order = self.epoch + 1, 0, None
        batch = self._epoch_order()[self.offset:self.offset + self.batch_size]
        self.offset += len(batch)
        return [int(i) for i in batch]

    def peek(self) -> list[int]:
        """The batch `next` gives, without moving: the first batch's rows can be checked before anything starts.

        >>> sampler = BatchSampler(5, 2, shuffle=False)
        >>> sampler.peek(), next(sampler), sampler.peek()
        ([0, 1], [0, 1], [2, 3])
        """
        return next(copy.copy(self))  # __next__ replaces the epoch order, never changes it in place

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "offset": self.offset, "num_rows": self.num_rows,
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Resume at a saved position; refuses a state saved for a different dataset size or order."""
        for key in ("num_rows", "batch_size", "seed", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data position was saved with {key}={state[key]!r} but this run has "
                                 f"{key}={getattr(self, key)!r}: resuming would not continue the same batches; "
                                 f"use the saved settings or start a fresh run in a new trainer.output_dir")
        if not (0 <= state["offset"] <= self.num_rows and state["epoch"] >= 0):
            raise ValueError(f"corrupt data position {state}")
        self.epoch, self.offset, self._order = int(state["epoch"]), int(state["offset"]), None


class PromptQueue:
    """Row indices from a BatchSampler in any amount: partial rollout asks for more or fewer prompts than a batch.

    `pending` (taken from the sampler, not handed out yet) is part of a run's position: a checkpoint saves it.

    >>> queue = PromptQueue(BatchSampler(5, 2, shuffle=False))
    >>> queue.take(3), queue.pending
    ([0, 1, 2], [3])
    >>> queue.take(1), queue.take(0), queue.pending
    ([3], [], [])
    """

    def __init__(self, sampler: Iterator[list[int]]):
        self.sampler = sampler
        self.pending: list[int] = []

    def take(self, count: int) -> list[int]:
        while len(self.pending) < count:
            self.pending.extend(next(self.sampler))
        taken, self.pending = self.pending[:count], self.pending[count:]
        return taken


def sequential_batches(num_rows: int, batch_size: int) -> list[list[int]]:
    """Every row once, in order, in batches of batch_size (the last one may be shorter); batch_size <= 0 = one batch.
    For validation: a short last batch is filled with padding rows by the batch module, never with repeated rows.

    >>> sequential_batches(5, 2)
    [[0, 1], [2, 3], [4]]
    """
    return chunks(range(num_rows), batch_size if batch_size > 0 else max(num_rows, 1))


# ---------------------------------------------------------------------------------------------------- requests


class RequestBuilder(Protocol):
    def build_request(self, row: dict[str, Any], index: int = -1) -> RolloutRequest: ...


@dataclass
class RequestBatch:
    """The requests built from a batch of rows, and the rows skipped on purpose (filtered, counted, logged)."""

    requests: list[RolloutRequest]
    skipped: list[FilteredRow] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)


def build_requests(processor: RequestBuilder, dataset: RLDataset, indices: Sequence[int]) -> RequestBatch:
    """Rows -> RolloutRequests. A row the processor filters (`FilteredRow`) is skipped and counted; a bad row
    (`BadRowError`, or any other error) is raised as a BadRowError naming the row, its file and its row in the file.
    A bad row's error is one message (its cause, in words, is in it) without a chain; any other error keeps its
    cause (`__cause__`): it is a bug in the processing rather than in the data, and its traceback is what matters."""
    requests, skipped = [], []
    for index in indices:
        row = dataset[index]
        try:
            requests.append(processor.build_request(row, index))
        except FilteredRow as skip:
            skipped.append(skip)
        except BadRowError as err:  # the processor knows the dataset index; the file and its row are named here
            path, local = dataset.locate(index)
            raise BadRowError(err.row_index, f"{err.reason} (row {local} of {path})") from None
        except Exception as err:
            path, local = dataset.locate(index)
            raise BadRowError(index, f"{type(err).__name__}: {err} (row {local} of {path})") from err
    if skipped:
        logger.warning("skipped %d of %d rows (first: %s)", len(skipped), len(indices), skipped[0])
    return RequestBatch(requests, skipped)
