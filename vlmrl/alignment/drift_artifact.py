"""The drift artifact: a small sample of each training step's engine and trainer logprobs, kept for the whole run.

OUTPUT_DIR/drift/step_<N>.jsonl holds step N's sampled rows, one JSON object per sample (`DriftRecord`). Each file is
written whole and renamed into place (`write_text_atomically`), so a killed run leaves complete steps only, and a
resumed run rewrites the steps it recomputes. Written by the fit loop (trainer.drift_fraction), read by
`python -m vlmrl.alignment.drift`.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from vlmrl.atomic import write_text_atomically

DRIFT_DIR = "drift"
KIND = "vlmrl.drift"
FORMAT_VERSION = 1
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl")


class DriftError(ValueError):
    """A drift folder or file that cannot be read (missing, corrupt, of another kind); the message names the file."""


@dataclass
class DriftRecord:
    """One sampled sample of one training step: both sides' logprobs of the tokens the update trained on."""

    step: int
    """The training step (1-based) whose rollout produced the sample."""
    uid: str
    """The request's uid (the GRPO group)."""
    row: int
    """Row of the sample in the step's batch."""
    data_source: str
    modality: str
    """text, image or video."""
    engine_weight_version: int
    """The training step whose weights the engine held when it sampled (0 = the initial or warmed-up weights)."""
    trainer_weight_version: int
    """The training step of the trainer's weights that scored the tokens (step - 1: before this step's update)."""
    token_ids: list[int]
    """The response tokens in the loss (response_mask 1), in order."""
    engine_logprobs: list[float]
    """The engine's raw logprob of each of those tokens."""
    trainer_logprobs: list[float]
    """The trainer's logprob of each (pre-update weights, at rollout.temperature)."""
    temperature: float = 1.0
    """rollout.temperature: the two sides compare only at 1 (the engine's logprobs are raw)."""
    max_staleness: int = 0
    """How many steps older than the trainer's the engine's weights may be by design: the asynchronous placement's
    trainer.async_rollout.max_staleness (0 in the synchronous loop)."""

    @property
    def weights_stale(self) -> bool:
        """The engine sampled with other weights than the ones it should have: older than the trainer's by more
        than the placement allows (the synchronous loop: any other)."""
        lag = self.trainer_weight_version - self.engine_weight_version
        return lag != 0 if self.max_staleness == 0 else not 0 <= lag <= self.max_staleness


_FIELDS = {f.name for f in fields(DriftRecord)}
_REQUIRED = {f.name for f in fields(DriftRecord) if f.default is MISSING}


def step_path(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / DRIFT_DIR / f"step_{step:06d}.jsonl"


def write_step(output_dir: str | os.PathLike, step: int, records: list[DriftRecord]) -> Path:
    """Step `step`'s records into OUTPUT_DIR/drift/step_<step>.jsonl, all at once (replacing an earlier one)."""
    lines = [json.dumps({"kind": KIND, "format_version": FORMAT_VERSION, **asdict(r)}, allow_nan=False)
             for r in records]
    return write_text_atomically(step_path(output_dir, step), "".join(line + "\n" for line in lines))


def drop_steps_after(output_dir: str | os.PathLike, step: int) -> None:
    """Delete the step files and weight probes (`vlmrl.alignment.weight_probe`) after `step`: what a run resumed
    from checkpoint `step` writes again."""
    from vlmrl.alignment.weight_probe import probe_files

    for path, found in [*_step_files(Path(output_dir) / DRIFT_DIR), *probe_files(output_dir)]:
        if found > step:
            path.unlink()


def _step_files(folder: Path) -> list[tuple[Path, int]]:
    if not folder.is_dir():
        return []
    found = [(path, _STEP_FILE.fullmatch(path.name)) for path in folder.iterdir()]
    return sorted(((path, int(m.group(1))) for path, m in found if m), key=lambda item: item[1])


def _record(line: str, path: Path, number: int) -> DriftRecord:
    where = f"{path}:{number}"
    try:
        data = json.loads(line)
    except json.JSONDecodeError as err:
        raise DriftError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise DriftError(f"{where}: not a drift record (kind {data.get('kind') if isinstance(data, dict) else None!r}"
                         f", expected {KIND!r})")
    if data.get("format_version") != FORMAT_VERSION:
        raise DriftError(f"{where}: format_version {data.get('format_version')!r}, this reader knows {FORMAT_VERSION}")
    missing = sorted(_REQUIRED - data.keys())
    if missing:
        raise DriftError(f"{where}: missing {missing}")
    record = DriftRecord(**{k: v for k, v in data.items() if k in _FIELDS})
    if not len(record.token_ids) == len(record.engine_logprobs) == len(record.trainer_logprobs):
        raise DriftError(f"{where}: {len(record.token_ids)} tokens but {len(record.engine_logprobs)} engine and "
                         f"{len(record.trainer_logprobs)} trainer logprobs")
    if not all(isinstance(v, (int, float)) and math.isfinite(v)
               for v in (*record.engine_logprobs, *record.trainer_logprobs)):
        raise DriftError(f"{where}: a logprob is not a finite number")
    return record


def read_drift(output_dir: str | os.PathLike) -> list[DriftRecord]:
    """Every record under OUTPUT_DIR/drift, step by step. Raises DriftError naming the file when there is none or one
    is unreadable."""
    folder = Path(output_dir) / DRIFT_DIR
    files = _step_files(folder)
    if not files:
        raise DriftError(f"{folder}: no drift/step_<N>.jsonl files (was the run trained with trainer.drift_fraction "
                         "> 0 on a backend that returns logprobs?)")
    records = []
    for path, step in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                record = _record(line, path, number)
                if record.step != step:
                    raise DriftError(f"{path}:{number}: a record of step {record.step} in the file of step {step}")
                records.append(record)
    return records
